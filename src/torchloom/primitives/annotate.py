"""``annotate(param_name, key, value)``: attach a tag to a parameter or buffer.

The tag is stored with the tensor (see :mod:`torchloom.core.meta`) and is also readable as
``tensor.<key>``. It survives ``shard`` (the sliced parameter inherits it), ``replace``
(the parameter object moves with its module), tracing, and ``build`` (re-created
parameters get every tag back).

Preconditions:
    * ``param_name`` names a parameter or buffer of this node's module (dotted names
      reach into sub-modules);
    * ``key`` is an identifier, not private (no leading underscore) and not an existing
      attribute of ``torch.Tensor`` (``"grad"``, ``"shape"``, ... would break the tensor);
    * ``key`` is not a tag (or attribute) the tensor already has with another value,
      unless ``overwrite=True``: a second ``annotate`` of a key is usually a clash between
      two parts of a schedule (a built-in schedule and the user's own), and the first
      value would be lost silently. Tagging a key again with the same value (same object,
      or an equal value of the same type) is accepted and changes nothing, so a schedule
      applied in two steps that both set a tag is not refused.

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

from ..core.errors import AnnotateError
from ..core.meta import get_meta, has_meta, set_tag
from ..core.registry import primitive
from ._common import find_tensor

if TYPE_CHECKING:
    from ..core.schedule import Schedule

NAME = "annotate"


def _same(a: Any, b: Any) -> bool:
    """Whether two tag values are the same value (identity, or equal values of one type;
    a comparison that fails or is not a plain bool, such as tensors', counts as other)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    try:
        equal = a == b
    except Exception:  # noqa: BLE001 - an odd __eq__ means "not provably the same"
        return False
    return equal is True


@primitive(NAME, errors=(AnnotateError,))
def apply(sch: Schedule, param_name: str, key: str, value: Any, *,
          overwrite: bool = False) -> None:
    """Tag ``param_name`` of ``sch.mod`` with ``key = value``."""
    _, _, tensor, _ = find_tensor(sch, param_name, NAME)
    if not isinstance(overwrite, bool):
        raise AnnotateError(
            f"overwrite must be True or False, not {overwrite!r}",
            path=sch.path, primitive=NAME, values={"param_name": param_name,
                                                   "overwrite": overwrite},
            fix=f"sch[{sch.path!r}].annotate({param_name!r}, {key!r}, value, overwrite=True)",
        )
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
    tags = get_meta(tensor).tags if has_meta(tensor) else {}
    if key in tags or key in tensor.__dict__:
        old = tags[key] if key in tags else tensor.__dict__[key]
        if not overwrite and not _same(old, value):
            raise AnnotateError(
                f"{param_name!r} already has the tag {key!r} with another value",
                path=sch.path,
                primitive=NAME,
                values={"param_name": param_name, "key": key, "old": _short(old),
                        "new": _short(value)},
                fix="replace it on purpose: "
                f"sch[{sch.path!r}].annotate({param_name!r}, {key!r}, value, overwrite=True), "
                "or pick another key",
            )
    set_tag(tensor, key, value)


def _short(value: Any) -> str:
    text = repr(value).replace("\n", " ")
    return text if len(text) <= 60 else text[:57] + "..."
