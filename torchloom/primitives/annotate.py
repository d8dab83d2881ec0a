"""``annotate(param_name, key, value)``: attach a tag to a parameter or buffer.

The tag is stored with the tensor (see :mod:`torchloom.meta`) and is also readable as
``tensor.<key>``. It survives ``shard`` (the sliced parameter inherits it), ``replace``
(the parameter object moves with its module), tracing, and ``build`` (re-created
parameters get every tag back).

Preconditions:
    * ``param_name`` names a parameter or buffer of this node's module (dotted names
      reach into sub-modules);
    * ``key`` is an identifier, not private (no leading underscore) and not an existing
      attribute of ``torch.Tensor`` (``"grad"``, ``"shape"``, ... would break the tensor).

Before / after:

>>> import torch, torchloom as tl
>>> model = torch.nn.Sequential(torch.nn.Linear(2, 2))
>>> sch = tl.create_schedule(model)
>>> hasattr(model[0].weight, "replicated")
False
>>> sch["0"].annotate("weight", "replicated", True)
>>> model[0].weight.replicated
True
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..errors import AnnotateError
from ..meta import set_tag
from ._common import find_tensor

if TYPE_CHECKING:
    from ..schedule import Schedule

NAME = "annotate"


def apply(sch: Schedule, param_name: str, key: str, value: Any) -> None:
    """Tag ``param_name`` of ``sch.mod`` with ``key = value``."""
    _, _, tensor, _ = find_tensor(sch, param_name, NAME)
    if not isinstance(key, str) or not key.isidentifier() or key.startswith("_"):
        raise AnnotateError(
            "a tag key must be a public identifier",
            path=sch.path,
            primitive=NAME,
            values={"param_name": param_name, "key": key},
            fix=f"use a name such as 'my_tag': sch[{sch.path!r}].annotate({param_name!r}, "
            "'my_tag', value)",
        )
    if hasattr(torch.Tensor, key) or hasattr(torch.nn.Parameter, key):
        raise AnnotateError(
            f"tag key {key!r} would hide torch.Tensor.{key}",
            path=sch.path,
            primitive=NAME,
            values={"param_name": param_name, "key": key},
            fix=f"pick another name, e.g. 'tl_{key}'",
        )
    set_tag(tensor, key, value)
