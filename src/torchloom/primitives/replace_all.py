"""``replace_all(module_type, make_mod_fn)``: replace every sub-module of a type.

Walks the nodes below (and including) this one, as they were before the call, and for
each whose module is an instance of ``module_type`` installs
``make_mod_fn(path, old_module)`` (or ``make_mod_fn(old_module)`` for a function of one
argument, as ``replace`` takes) with :mod:`~torchloom.primitives.replace` semantics
(hooks and mode carried over). ``path`` is relative to this node. Modules created by the
factory are not visited again. The call is recorded once in the recipe.

Preconditions:
    * ``module_type`` is a subclass of ``nn.Module``;
    * at least one node matches (nothing is silently skipped);
    * ``make_mod_fn`` can be called as ``fn(path, module)`` (preferred when both fit) or
      ``fn(module)``; any other signature is refused before anything is replaced;
    * ``make_mod_fn`` returns an ``nn.Module``.

Before / after:

>>> import torchloom as tl
>>> from torch import nn
>>> model = nn.Sequential(nn.Linear(2, 2), nn.GELU(), nn.Sequential(nn.GELU()))
>>> sch = tl.create_schedule(model)
>>> sch.replace_all(nn.GELU, lambda path, old: nn.ReLU())
>>> [type(m).__name__ for m in model.modules()]
['Sequential', 'Linear', 'ReLU', 'Sequential', 'ReLU']
"""

from __future__ import annotations

import inspect
from collections import Counter
from typing import TYPE_CHECKING, Callable

from torch import nn

from ..core.errors import ReplaceError
from ..core.registry import primitive

if TYPE_CHECKING:
    from ..core.schedule import Schedule

NAME = "replace_all"


@primitive(NAME, errors=(ReplaceError,))
def apply(
    sch: Schedule,
    module_type: type[nn.Module],
    make_mod_fn: Callable[[str, nn.Module], nn.Module] | Callable[[nn.Module], nn.Module],
) -> None:
    """Replace each module below ``sch`` that is a ``module_type``."""
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise ReplaceError(
            f"module_type must be an nn.Module subclass, not {module_type!r}",
            path=sch.path,
            primitive=NAME,
            values={"module_type": repr(module_type)},
            fix="pass the class itself, e.g. sch.replace_all(nn.GELU, make_fast_gelu)",
        )
    matches = [(path, node) for path, node in list(sch.named_schedules())
               if isinstance(node.mod, module_type)]
    if not matches:
        present = Counter(type(node.mod).__name__ for _, node in sch.named_schedules())
        raise ReplaceError(
            f"no module below this node is a {module_type.__name__}",
            path=sch.path,
            primitive=NAME,
            values={"module_type": module_type.__name__,
                    "types_present": sorted(present)[:12]},
            fix="check the class (transformers models often use their own subclasses)",
        )
    takes_path = _takes_path(sch, make_mod_fn)
    make: Callable[..., nn.Module] = make_mod_fn  # in the form _takes_path found
    for path, node in matches:
        if takes_path:
            node.replace(lambda old, _path=path: make(_path, old))
        else:
            node.replace(lambda old: make(old))


def _takes_path(sch: Schedule, fn: Callable[..., nn.Module]) -> bool:
    """Whether ``fn`` is called as ``fn(path, module)`` (True) or ``fn(module)`` (False);
    raises before any replacement when it is neither."""
    if not callable(fn) or isinstance(fn, nn.Module):
        raise ReplaceError(
            f"make_mod_fn must be a function (path, old_module) -> new_module, not a "
            f"{type(fn).__name__}",
            path=sch.path, primitive=NAME, values={"make_mod_fn": type(fn).__name__},
            fix="sch.replace_all(nn.GELU, lambda path, old: MyGelu()); one module instance "
            "cannot sit at several places",
        )
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return True  # not inspectable (a builtin): the documented form
    for args, takes_path in ((("path", None), True), ((None,), False)):
        try:
            sig.bind(*args)
        except TypeError:
            continue
        return takes_path
    raise ReplaceError(
        f"make_mod_fn takes {sig}, but it is called as fn(path, old_module) or "
        "fn(old_module)",
        path=sch.path, primitive=NAME,
        values={"make_mod_fn": getattr(fn, "__qualname__", type(fn).__name__),
                "signature": str(sig)},
        fix="def make(path, old): return MyModule(...)  # or lambda old: MyModule(...); "
        "then sch.replace_all(module_type, make)",
    )
