"""What ``build`` knows of each tensor while it runs a model's init code, and the dispatch
mode that watches that code.

:class:`_Entry` is one tensor of the model (its slots, shard spec, mode: made, kept,
loaded...); :class:`_Active` what one init call does with it; :class:`_Watch` follows the
operators an init call runs (a dry run on ``meta`` copies, then the real call, whose
random draws on ``init="local"`` slices it routes to their own generators). The builder
that uses them is :mod:`torchloom.runtime.materialise`; the design is in
``docs/design/build.md``.

>>> _blank((2,), torch.ones(1), torch.device("cpu"))   # "never written"
tensor([nan, nan])
>>> _own_init(torch.nn.Linear(2, 2)).__name__, _own_init(torch.nn.ReLU())
('reset_parameters', None)
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..core.errors import BuildError
from ..core.meta import ShardSpec

__all__ = ["INIT_MODES"]

PRIMITIVE = "build"


def _pretrained_model_class() -> type | None:
    """transformers' ``PreTrainedModel`` if transformers is imported (a model built from it
    can only exist then), else None; avoids importing transformers for plain models."""
    module = sys.modules.get("transformers.modeling_utils")
    return getattr(module, "PreTrainedModel", None) if module is not None else None


def _own_init(module: nn.Module) -> Callable[[], Any] | None:
    """The module's own init: ``reset_parameters``, or the private ``_reset_parameters`` that
    ``nn.MultiheadAttention`` and ``nn.Transformer`` call at the end of their constructor."""
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        return reset
    if isinstance(module, (nn.MultiheadAttention, nn.Transformer)):
        return module._reset_parameters
    return None


def _accepts_path(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` can be called as ``fn(module, path)``."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    try:
        sig.bind(None, "")
    except TypeError:
        return False
    return True


def _tensors_of(module: nn.Module) -> Iterable[tuple[str, torch.Tensor, bool]]:
    for name, p in module._parameters.items():
        if p is not None:
            yield name, p, True
    for name, b in module._buffers.items():
        if b is not None:
            yield name, b, False


# Modes of a tensor during build.
_NEW = "new"          # was meta, or real-but-sharded under init_weights: initialised, kept
_INPLACE = "inplace"  # real, unsharded, init_weights=True: initialised in place
_KEEP = "keep"        # real, init_weights=False: protected by snapshot / restore
_SCRATCH = "scratch"  # real sharded slice, init_weights=False: a throwaway full tensor per call
_LOADED = "loaded"    # covered by weights=: read from the files, never initialised
_ELSEWHERE = "elsewhere"  # target="pipeline" with weights=: another rank's stage; stays meta

INIT_MODES: tuple[str, ...] = ("full", "local")


@dataclass
class _Entry:
    orig: torch.Tensor
    name: str                      # dotted name of the first slot
    home: nn.Module                # first module holding it, in named_modules() order
    home_attr: str
    is_param: bool
    spec: ShardSpec | None
    mode: str
    slots: list[tuple[nn.Module, str, bool]] = field(default_factory=list)
    rest: torch.Tensor | None = None    # what its slots hold between init calls
    local: torch.Tensor | None = None   # the value it keeps (this rank's part), once made
    initialised: bool = False
    replaced: bool = False
    hf_flag: Any = None
    gen: torch.Generator | None = None  # init="local": this shard's own stream
    located: Any = None                 # weights=: where the files hold it

    @property
    def initialising(self) -> bool:
        return self.mode in (_NEW, _INPLACE)

    @property
    def split(self) -> bool:
        """Whether this rank keeps only a part of it (a shard of a world larger than 1)."""
        return self.spec is not None and self.spec.world_size > 1

    @property
    def full_shape(self) -> tuple[int, ...]:
        return tuple(self.spec.full_shape) if self.spec is not None else tuple(self.orig.shape)


def _error(problem: str, values: dict[str, Any], fix: str, path: str | None = "") -> BuildError:
    return BuildError(problem, path=path, primitive=PRIMITIVE, values=values, fix=fix)


def _storage_key(t: Any) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


def _is_float(t: torch.Tensor) -> bool:
    return t.dtype.is_floating_point or t.dtype.is_complex


def _has_nan(t: torch.Tensor, block: int = 1 << 24) -> bool:
    """Whether ``t`` holds a NaN (checked in blocks: no full-size boolean temporary)."""
    if not _is_float(t):
        return False
    flat = t.detach().reshape(-1)
    return any(bool(torch.isnan(flat[i:i + block]).any()) for i in range(0, flat.numel(), block))


def _blank(shape: tuple[int, ...], like: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A new tensor of ``shape``: NaN ("never written") when floating, else zeros."""
    if _is_float(like):
        return torch.full(shape, float("nan"), dtype=like.dtype, device=device)
    return torch.zeros(shape, dtype=like.dtype, device=device)


# Ops that treat every element alike, whatever its position: an init made only of them
# gives a rank's slice the same distribution whether it runs on the slice or on the full
# tensor (init="local" runs it on the slice). Anything else (indexing a row, a view with
# another layout, a copy from a full-shape tensor, orthogonal_) is "positional".
_ELEMENTWISE = frozenset({
    "normal_", "uniform_", "bernoulli_", "exponential_", "log_normal_", "cauchy_",
    "geometric_", "random_", "fill_", "zero_", "copy_", "mul_", "div_", "add_", "sub_",
    "clamp_", "clamp_min_", "clamp_max_", "erfinv_", "sqrt_", "abs_", "neg_", "exp_",
    "log_", "pow_", "tanh_", "sigmoid_", "mul", "div", "add", "sub", "clamp", "erfinv",
    "_to_copy", "clone", "detach", "alias", "lift_fresh", "empty_like", "zeros_like",
    "ones_like", "full_like",
})
_RANDOM = frozenset({"normal_", "uniform_", "bernoulli_", "exponential_", "log_normal_",
                     "cauchy_", "geometric_", "random_"})


class _Watch(TorchDispatchMode):
    """Follows the operators an init call runs on the build's tensors.

    As a *probe* (``probe=True``) every operator runs on ``meta`` copies of its tensor
    arguments, so nothing is written, nothing allocated and no random number drawn; it
    records which entries the call touches (``touched``) and which it touches with a
    positional operator (``positional``). In the real call it refuses a touch of an entry
    the probe did not predict (``guard``), and sends the random draws on the slices of
    ``init="local"`` entries (``route``) to their own generators. Outputs computed from
    an entry are followed too (``w.data.to(float32)`` and what is drawn into it)."""

    def __init__(self, keys: dict[int, _Entry], *, probe: bool,
                 guard: dict[int, _Entry] | None = None,
                 route: dict[int, _Entry] | None = None) -> None:
        super().__init__()
        self.keys = keys
        self.probe = probe
        self.guard = guard or {}
        self.route = route or {}
        self.taint: dict[int, _Entry] = {}
        self.touched: dict[int, _Entry] = {}
        self.positional: set[int] = set()

    def _entry(self, t: torch.Tensor) -> _Entry | None:
        key = _storage_key(t)
        if key is None:
            return None
        return self.keys.get(key) or self.taint.get(key)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        flat, tree = tree_flatten((args, kwargs))
        hits: list[tuple[_Entry, int]] = []
        for i, x in enumerate(flat):
            if isinstance(x, torch.Tensor):
                e = self._entry(x)
                if e is not None:
                    hits.append((e, i))
        name = func.overloadpacket.__name__
        if self.probe:
            for e, i in hits:
                self.touched[id(e)] = e
                if name not in _ELEMENTWISE or any(
                        isinstance(x, torch.Tensor) and j != i and x.numel() > 1
                        and self._entry(x) is not e for j, x in enumerate(flat)):
                    self.positional.add(id(e))
            flat = [x.detach().to("meta") if isinstance(x, torch.Tensor) and not x.is_meta
                    else x for x in flat]
            args, kwargs = tree_unflatten(flat, tree)
            if "device" in kwargs:
                kwargs["device"] = torch.device("meta")
            out = func(*args, **kwargs)
        else:
            for e, i in hits:
                key = _storage_key(flat[i])
                if key in self.guard and self.guard[key] is e:
                    raise _error(
                        f"the init code touched {e.name!r} in a way build could not "
                        "foresee (its dry run on meta tensors did not touch it)",
                        {"tensor": e.name, "operator": str(func)},
                        "initialise this module yourself: build(sch, param_init_fn=fn)",
                        path=e.name.rpartition(".")[0])
            routed = [e for e, _ in hits if id(e) in self.route]
            if routed and name in _RANDOM:
                kwargs["generator"] = routed[0].gen
            out = func(*args, **kwargs)
            hits = [(e, i) for e, i in hits if id(e) in self.route]
        if hits:
            for y in tree_flatten(out)[0]:
                if isinstance(y, torch.Tensor):
                    key = _storage_key(y)
                    if key is not None and key not in self.keys:
                        self.taint[key] = hits[0][0]
        return out


@contextlib.contextmanager
def _full_fan_in(local: dict[int, _Entry]) -> Iterator[None]:
    """While active, torch.nn.init computes fan-in and fan-out of an ``init="local"``
    slice from its full shape (``kaiming_*``, ``xavier_*``, ``nn.Linear``'s bias bound)."""
    original = nn.init._calculate_fan_in_and_fan_out

    def fans(tensor: torch.Tensor) -> tuple[int, int]:
        e = local.get(_storage_key(tensor) or -1)
        if e is not None and e.spec is not None and tuple(tensor.shape) == e.spec.local_shape():
            return original(torch.empty(e.full_shape, device="meta"))
        return original(tensor)

    nn.init._calculate_fan_in_and_fan_out = fans
    try:
        yield
    finally:
        nn.init._calculate_fan_in_and_fan_out = original


def _seed_of(e: _Entry) -> int:
    """The seed of a shard's own stream: the process seed, the shard's piece (its rank,
    unless ranks share a piece: ShardSpec.replicas, whose copies must agree) and name."""
    spec = e.spec
    assert spec is not None
    text = f"{torch.initial_seed()}:{spec.piece}:{spec.pieces}:{e.name}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


@dataclass
class _Active:
    """What one init call does with one entry."""

    e: _Entry
    tensor: torch.Tensor | None     # what its slots hold during the call
    kind: str                       # "keep", "snapshot", "throwaway", "local", "slice"
    saved: torch.Tensor | None = None
    routed: bool = False            # init="local": its draws come from its own stream
    expanded: bool = False          # "slice": made from this rank's part of an earlier call
    had_nan: bool = False
