"""Ranks agree: every rank of a schedule's process group must have scheduled the same way.

Tensor parallelism only computes the right thing when every rank of the group applied the
same primitives with the same arguments: a rank that shards a fused q/k/v weight with
``chunks=3`` where the others used 1, or that skips one ``sync``, trains on with wrong
losses and no error. :func:`check_ranks_agree` (called by :func:`torchloom.build` before
it materialises anything, and by :class:`torchloom.Verify` when its block is entered and
when it exits) proves the ranks agree:

1. each rank renders its recipe as text, one line per entry (the primitive, the path and
   the arguments bound to their parameter names with defaults filled in, so
   ``shard('w', 0)`` equals ``shard('w', 0, chunks=1)``; an argument that is not data,
   such as a lambda or a module, is rendered by its type and qualified name, never by its
   address, so equal code gives equal text on every rank), and lists its local
   parameters with their shapes and dtypes;
2. each rank hashes both lists into a fixed-size digest (a handful of int64 values) and
   the group all-gathers the digests: one small collective, whatever the model's size;
3. only when some digest differs are the texts themselves all-gathered, and every rank
   raises :class:`~torchloom.core.errors.ScheduleMismatchError` naming the first recipe line
   that differs between it and the lowest rank that disagrees with it (the line's text
   on both ranks, as it was called), or, when the recipes agree, the first parameter
   whose local shape differs.

Nothing is checked without an initialised process group, in a group of one, or under
the ``fake`` backend (``torch.testing._internal.distributed.fake_pg``, used to simulate
scale in one process: its collectives do nothing and it cannot disagree). Every rank of
the group must call the check (it is a collective), as every rank calls ``build``.

>>> import torch, torchloom as tl
>>> sch = tl.create_schedule(torch.nn.Sequential(torch.nn.Linear(4, 6)))
>>> sch["0"].shard("weight", 0, chunks=2)
>>> recipe_lines(sch.recipe)
["sch['0'].shard('weight', 0, chunks=2)"]
>>> shape_lines(sch.mod)
['0.weight: (6, 4) torch.float32', '0.bias: (6,) torch.float32']
>>> canonical_text(sch.recipe[0])
"sch['0'].shard(param_name='weight', axis=0, chunks=2, tied=False)"
>>> check_ranks_agree(sch)   # no process group: nothing to compare
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ..core.errors import ScheduleMismatchError
from .collectives import guard_collective

if TYPE_CHECKING:
    from ..core.recipe import Recipe, RecipeEntry
    from ..core.schedule import Schedule

__all__ = ["check_ranks_agree", "recipe_lines", "canonical_text", "shape_lines", "module_lines",
           "digest"]

_MAGIC = 0x746C61  # "tla": a slot a collective never wrote stays 0, never this
_MAX_DEPTH = 8


# --------------------------------------------------------------------------- the texts


def _name_of(obj: Any) -> str:
    module = getattr(obj, "__module__", None) or "?"
    qualname = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return f"{module}:{qualname}"


def _text(value: Any, depth: int = 0) -> str:
    """A rank-independent rendering of a recipe argument (no memory addresses)."""
    if depth > _MAX_DEPTH:
        return "..."
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return repr(value)
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, torch.Tensor):
        return f"Tensor({tuple(value.shape)}, {value.dtype})"
    if isinstance(value, list):
        return "[" + ", ".join(_text(v, depth + 1) for v in value) + "]"
    if isinstance(value, tuple):
        inner = ", ".join(_text(v, depth + 1) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(_text(v, depth + 1) for v in value)) + "}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_text(k, depth + 1)}: {_text(v, depth + 1)}"
                               for k, v in value.items()) + "}"
    if isinstance(value, functools.partial):
        parts = [_text(value.func, depth + 1)] + [_text(a, depth + 1) for a in value.args]
        parts += [f"{k}={_text(v, depth + 1)}" for k, v in value.keywords.items()]
        return f"partial({', '.join(parts)})"
    if isinstance(value, nn.Module):
        return f"<{_name_of(type(value))} module {_module_config(value)}>"
    if isinstance(value, type) or (callable(value) and hasattr(value, "__qualname__")):
        return _name_of(value)
    return f"<{_name_of(type(value))} object>"


_SCALARS = (bool, int, float, str, type(None))


def _rank_free(module: nn.Module) -> bool:
    """Whether ``module``'s printed form and attributes are the same on every rank that
    configured it the same way: torch's and transformers' layers without tensors of their
    own (dropout, activations, containers). torchloom's own ops and layers with tensors
    may print and hold their rank's slice (a vocabulary-parallel embedding's rows, a
    localised ``padding_idx``); their shapes are compared instead."""
    if type(module).__module__.startswith("torchloom."):
        return False
    # a layer with tensors of its own is compared by its shapes: its printed fields may be
    # its rank's (a localised padding_idx, even where the shard spec sits on a tied tensor)
    return not any(t is not None for t in (*module._parameters.values(),
                                           *module._buffers.values()))


def _layer_text(module: nn.Module) -> str:
    extra = module.extra_repr() if _rank_free(module) else ""
    return f"{type(module).__qualname__}({extra}) {'train' if module.training else 'eval'}"


def _module_config(module: nn.Module) -> str:
    """What configures a module passed to a primitive, the same on every rank that made
    it the same way: each layer's class and ``extra_repr`` (a ``Dropout``'s ``p``, a
    ``Linear``'s sizes), the public scalar attributes, the training flags, and a
    transformers config (torchloom's own ops by class only: they hold their rank's slice)."""
    parts = []
    for name, sub in module.named_modules():
        attrs = {k: v for k, v in vars(sub).items() if not k.startswith("_") and (
            isinstance(v, _SCALARS) or (isinstance(v, tuple)
                                        and all(isinstance(x, _SCALARS) for x in v)))
                 } if _rank_free(sub) else {}
        parts.append(f"{name or '.'}: {_layer_text(sub)} {sorted(attrs.items())!r}")
        config = getattr(sub, "config", None)
        to_dict = getattr(config, "to_dict", None)
        if callable(to_dict):
            try:
                parts.append(json.dumps(to_dict(), sort_keys=True, default=str))
            except (TypeError, ValueError):
                parts.append(repr(config))
    return " ".join(parts)


def module_lines(model: nn.Module) -> list[str]:
    """``"path: Type(extra_repr) train|eval"`` for every module: a replaced module's class
    and configuration (a ``Dropout``'s ``p``, a layer's sizes) as every rank must have it."""
    return [f"{name or '.'}: {_layer_text(mod)}" for name, mod in model.named_modules()]


def entry_text(entry: RecipeEntry) -> str:
    """One recipe entry as a line, the same on every rank that made the same call."""
    parts = [_text(a) for a in entry.args]
    parts += [f"{k}={_text(v)}" for k, v in entry.kwargs.items()]
    return f"sch[{entry.path!r}].{entry.primitive}({', '.join(parts)})"


def recipe_lines(recipe: Recipe) -> list[str]:
    """The recipe as it is shown in a mismatch: one line per entry, as it was called."""
    return [entry_text(e) for e in recipe]


def canonical_text(entry: RecipeEntry) -> str:
    """The entry with every argument bound to its parameter name and defaults filled in,
    so that ``shard('w', 0)`` and ``shard('w', 0, chunks=1)`` compare equal; the line as
    called when the primitive's signature does not take these arguments."""
    from ..core.schedule import Schedule

    method = getattr(Schedule, entry.primitive, None)
    if method is None:
        return entry_text(entry)
    try:
        bound = inspect.signature(method).bind(None, *entry.args, **entry.kwargs)
    except (TypeError, ValueError):
        return entry_text(entry)
    bound.apply_defaults()
    parts = []
    for name, value in list(bound.arguments.items())[1:]:
        if isinstance(value, dict) and name == "kwargs":  # **kwargs, in a stable order
            parts += [f"{k}={_text(v)}" for k, v in sorted(value.items())]
        else:
            parts.append(f"{name}={_text(value)}")
    return f"sch[{entry.path!r}].{entry.primitive}({', '.join(parts)})"


def shape_lines(model: nn.Module) -> list[str]:
    """``"name: shape dtype"`` for every local parameter (tied ones once)."""
    return [f"{name}: {tuple(p.shape)} {p.dtype}" for name, p in model.named_parameters()]


def _hash(lines: list[str]) -> int:
    raw = hashlib.blake2b("\n".join(lines).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little", signed=True)


def digest(lines: list[str], shapes: list[str]) -> torch.Tensor:
    """The fixed-size fingerprint all-gathered first (int64, 5 values)."""
    return torch.tensor([_MAGIC, len(lines), _hash(lines), len(shapes), _hash(shapes)],
                        dtype=torch.int64)


# --------------------------------------------------------------------------- the check


def _device(group: Any) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or backend == "mpi" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _first_difference(mine: list[str], theirs: list[str]) -> int | None:
    for index, (a, b) in enumerate(zip(mine, theirs)):
        if a != b:
            return index
    if len(mine) != len(theirs):
        return min(len(mine), len(theirs))
    return None


def _line(lines: list[str], index: int, what: str = "the recipe ends after line") -> str:
    if index < len(lines):
        return lines[index]
    return f"(nothing: {what} {len(lines)})"


def _gather_texts(data: dict[str, list[str]], world: int, group: Any,
                  device: torch.device, primitive: str) -> list[dict[str, list[str]]]:
    """All-gather one JSON document per rank (as bytes, not pickles: a peer's data is
    parsed, never unpickled)."""
    raw = torch.frombuffer(bytearray(json.dumps(data).encode()), dtype=torch.uint8).to(device)
    size = torch.tensor([raw.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    with guard_collective("all_gather", primitive, group):
        dist.all_gather(sizes, size, group=group)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: raw.numel()] = raw
    pieces = [torch.zeros_like(padded) for _ in range(world)]
    with guard_collective("all_gather", primitive, group):
        dist.all_gather(pieces, padded, group=group)
    out = []
    for piece, n in zip(pieces, sizes):
        doc = json.loads(bytes(piece[: int(n.item())].cpu().tolist()).decode())
        out.append({key: [str(x) for x in doc[key]] for key in data})
    return out


def check_ranks_agree(sch: Schedule, primitive: str = "build") -> None:
    """Raise :class:`ScheduleMismatchError` on every rank when the ranks of the schedule's
    group scheduled differently; a no-op without a real process group of two or more.

    Precondition: every rank of ``sch.root.group`` (the default group when it is None)
    calls it, as it is collective. Cost: one all-gather of 5 int64 values per rank; the
    texts are gathered only when the ranks disagree.
    """
    root = sch.root
    group = root.group
    if not (dist.is_available() and dist.is_initialized()):
        return
    if str(dist.get_backend(group)).lower() == "fake":
        return  # a simulated group: collectives do nothing, ranks cannot disagree
    world = dist.get_world_size(group)
    if world <= 1:
        return
    me = dist.get_rank(group)
    canonical = [canonical_text(e) for e in root.recipe]
    params = shape_lines(root.mod)
    shapes = params + module_lines(root.mod)
    device = _device(group)
    mine = digest(canonical, shapes).to(device)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    with guard_collective("all_gather", primitive, group):
        dist.all_gather(gathered, mine, group=group)
    if not torch.equal(gathered[me], mine):
        return  # the backend did not run the collective: nothing was compared
    differing = [r for r, d in enumerate(gathered) if not torch.equal(d, mine)]
    if not differing:
        return
    lines = recipe_lines(root.recipe)
    texts = _gather_texts({"canonical": canonical, "lines": lines, "shapes": shapes}, world,
                          group, device, primitive)
    other = differing[0]
    other_lines, other_shapes = texts[other]["lines"], texts[other]["shapes"]
    # build(...) is called on the root, not on a node; Verify names the root it checks
    where = None if primitive == "build" else root.path
    index = _first_difference(canonical, texts[other]["canonical"])
    if index is not None:
        entries = list(root.recipe)
        raise ScheduleMismatchError(
            f"rank {me} and rank {other} scheduled differently: recipe line {index + 1} "
            "differs",
            path=where,
            primitive=primitive,
            values={"line": index + 1, "this_rank": me,
                    "this_line": _line(lines, index), "other_rank": other,
                    "other_line": _line(other_lines, index),
                    "path": entries[index].path if index < len(entries) else None,
                    "ranks_that_differ_from_this_one": differing},
            fix="apply the same primitives with the same arguments on every rank of the "
            "group (the schedule must not depend on the rank); compare print(sch.recipe) "
            f"on rank {me} and rank {other}",
        )
    index = _first_difference(shapes, other_shapes)
    assert index is not None  # the digests differ, so one of the two lists does
    ends = "the model has only this many parameters and modules:"
    what = (f"parameter {index + 1}" if index < len(params)
            else f"module {index - len(params) + 1} (its class or configuration)")
    raise ScheduleMismatchError(
        f"rank {me} and rank {other} have the same recipe but other local parameters or "
        f"modules: {what} differs",
        path=where,
        primitive=primitive,
        values={"this_rank": me, "this_parameter": _line(shapes, index, ends),
                "other_rank": other, "other_parameter": _line(other_shapes, index, ends),
                "ranks_that_differ_from_this_one": differing},
        fix="build every rank from the same model class and config, and apply the schedule "
        "to the unmodified model on every rank",
    )
