"""Materialisation: a model's ``meta`` (delayed) tensors made real, one module at a time.

Construct a model under :func:`init_empty_weights` (its parameters land on ``meta``,
nothing is allocated); :func:`torchloom.build` then calls :func:`_materialise`, which runs
the model's own init code (``reset_parameters``, transformers' ``_init_weights``, or
``param_init_fn``) in eager-construction order and/or reads ``weights=``, keeping only
this rank's slice of each sharded tensor. Design (memory, init order, ``init="local"``,
what is never overwritten): ``docs/design/build.md``.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..core.errors import BuildError
from ..core.meta import _ATTR as _META_ATTR
from ..core.meta import ShardSpec, copy_meta, shard_spec
from ..core.schedule import join_path

__all__ = ["init_empty_weights", "has_meta_tensors", "INIT_MODES"]

PRIMITIVE = "build"
_HF_FLAG = "_is_hf_initialized"

# --------------------------------------------------------------------------- init_empty_weights


def _param_to_meta(module: nn.Module, name: str) -> None:
    param = module._parameters.get(name)
    if param is None or param.is_meta:
        return
    module._parameters[name] = _param_like(param, param.detach().to("meta"), keep_hf_flag=True)


def _buffer_to_meta(module: nn.Module, name: str) -> None:
    buf = module._buffers.get(name)
    if buf is None or buf.is_meta:
        return
    module._buffers[name] = buf.detach().to("meta")


@contextlib.contextmanager
def init_empty_weights(include_buffers: bool = False) -> Iterator[None]:
    """Construct modules without allocating their weights.

    While active, every parameter registered on any ``nn.Module`` (``self.w =
    nn.Parameter(...)`` or ``register_parameter``) is moved to the ``meta`` device, keeping
    its Parameter subclass, ``requires_grad`` and attributes. Buffers stay real unless
    ``include_buffers=True``. Pass the model to :func:`build` to materialise it.

    The patch of ``nn.Module.register_parameter`` (and ``register_buffer``) is global while
    the context is active (other threads see it too), is undone on exit even when the body
    raises, and nests: an inner context restores what the outer one installed.

    A constructor's ``torch.empty`` still allocates for a moment (untouched memory, freed
    when the parameter moves to ``meta``); tensor factories that draw random numbers
    (``torch.randn``) still draw.

    >>> import torch
    >>> with init_empty_weights():
    ...     bn = torch.nn.BatchNorm1d(4)
    >>> bn.weight.device.type, bn.running_mean.device.type
    ('meta', 'cpu')
    >>> with init_empty_weights(include_buffers=True):
    ...     bn = torch.nn.BatchNorm1d(4)
    >>> bn.running_mean.device.type
    'meta'
    """
    previous_param = nn.Module.register_parameter
    previous_buffer = nn.Module.register_buffer

    def register_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        previous_param(self, name, param)
        if param is not None:
            _param_to_meta(self, name)

    def register_buffer(self: nn.Module, name: str, tensor: torch.Tensor | None,
                        persistent: bool = True) -> None:
        previous_buffer(self, name, tensor, persistent)
        if tensor is not None:
            _buffer_to_meta(self, name)

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    if include_buffers:
        nn.Module.register_buffer = register_buffer  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = previous_param  # type: ignore[method-assign]
        nn.Module.register_buffer = previous_buffer  # type: ignore[method-assign]


# --------------------------------------------------------------------------- helpers


def _param_like(old: torch.Tensor, data: torch.Tensor, keep_hf_flag: bool = False) -> torch.Tensor:
    """A tensor holding ``data`` that looks like ``old``: same Parameter subclass (for a
    parameter), ``requires_grad``, attributes and torchloom metadata."""
    new: torch.Tensor
    if isinstance(old, nn.Parameter):
        cls = type(old)
        try:
            new = cls(data, requires_grad=old.requires_grad)
        except TypeError:  # a subclass whose constructor takes other arguments
            new = torch.Tensor._make_subclass(cls, data, old.requires_grad)
    else:
        new = data
    for key, value in old.__dict__.items():
        if key == _META_ATTR or (key == _HF_FLAG and not keep_hf_flag):
            continue
        new.__dict__[key] = value
    copy_meta(old, new)
    # gradient hooks registered on the old tensor (sync("param_grad") registers one on a
    # meta parameter at schedule time) act on the new one
    if getattr(old, "_backward_hooks", None):
        new._backward_hooks = old._backward_hooks
    if getattr(old, "_post_accumulate_grad_hooks", None):
        new._post_accumulate_grad_hooks = old._post_accumulate_grad_hooks
    return new


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

    nn.init._calculate_fan_in_and_fan_out = fans  # type: ignore[assignment]
    try:
        yield
    finally:
        nn.init._calculate_fan_in_and_fan_out = original  # type: ignore[assignment]


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


# --------------------------------------------------------------------------- the builder


class _Builder:
    def __init__(self, model: nn.Module, init_weights: bool, device: torch.device,
                 param_init_fn: Callable[..., Any] | None, init: str = "full") -> None:
        self.model = model
        self.init_weights = init_weights
        self.device = device
        self.fn = param_init_fn
        self.fn_takes_path = param_init_fn is not None and _accepts_path(param_init_fn)
        self.local_init = init == "local"
        self.ptm = _pretrained_model_class()
        self.entries: list[_Entry] = []
        self.by_orig: dict[int, _Entry] = {}  # by id of the tensor before build
        self.by_key: dict[int, _Entry] = {}   # by storage of the tensor its slots hold
        self.held: dict[int, list[_Entry]] = {}  # by id of a module: the entries it holds
        self._pending: dict[int, bool] = {}
        self._direct: set[int] = set()
        self._visited: set[int] = set()
        self.probe_fallbacks = 0

    # ---------------------------------------------------------------- collect

    def collect(self) -> None:
        by_orig = self.by_orig
        for path, module in self.model.named_modules():
            for attr, tensor, is_param in _tensors_of(module):
                entry = by_orig.get(id(tensor))
                if entry is None:
                    entry = _Entry(orig=tensor, name=join_path(path, attr), home=module,
                                   home_attr=attr, is_param=is_param,
                                   spec=shard_spec(tensor), mode="")
                    entry.mode = self._mode_of(entry)
                    by_orig[id(tensor)] = entry
                    self.entries.append(entry)
                entry.slots.append((module, attr, is_param))
                self.held.setdefault(id(module), []).append(entry)

    def _mode_of(self, e: _Entry) -> str:
        sliced = e.spec is not None and tuple(e.spec.full_shape) != tuple(e.orig.shape)
        if e.orig.is_meta:
            return _NEW
        if self.init_weights:
            return _NEW if sliced else _INPLACE
        return _SCRATCH if sliced else _KEEP

    def mark_elsewhere(self, keep: set[int]) -> None:
        """Entries whose tensors (ids before build) are not in ``keep`` belong to stages of
        other pipeline ranks: they stay on ``meta``, neither read nor initialised."""
        for e in self.entries:
            if id(e.orig) not in keep and e.orig.is_meta:
                e.mode = _ELSEWHERE

    def mark_loaded(self, covered: Iterable[int]) -> None:
        """The entries (ids of their tensors) that weights= provides are never initialised."""
        for key in covered:
            self.by_orig[key].mode = _LOADED

    def finish_collect(self) -> None:
        for e in self.entries:
            if e.initialising:
                for module, _, _ in e.slots:
                    self._direct.add(id(module))

    def check_shard_specs(self) -> None:
        for e in self.entries:
            if e.spec is None or e.mode not in (_NEW, _SCRATCH, _LOADED):
                continue
            spec = e.spec
            ok = (0 <= spec.axis < len(spec.full_shape) and spec.world_size >= 1
                  and 0 <= spec.rank < spec.world_size
                  and spec.replicas >= 1 and spec.world_size % spec.replicas == 0
                  and spec.full_shape[spec.axis] % (spec.pieces * spec.chunks) == 0
                  and tuple(e.orig.shape) == spec.local_shape())
            if not ok:
                raise _error(
                    f"the shape of {e.name!r} does not match its shard spec",
                    {"name": e.name, "shape": tuple(e.orig.shape),
                     "local_shape": spec.local_shape(), "full_shape": spec.full_shape,
                     "axis": spec.axis, "world_size": spec.world_size, "rank": spec.rank},
                    "shard tensors only through sch[...].shard(...) and do not resize them "
                    "afterwards; rebuild the schedule from a fresh model",
                )

    def needs_work(self) -> bool:
        return any(e.initialising or e.mode == _LOADED for e in self.entries)

    def needs_walk(self) -> bool:
        return any(e.initialising for e in self.entries)

    # ---------------------------------------------------------------- pre-check

    def check_coverage(self) -> None:
        """Every module with a meta parameter must have some init code."""
        if self.fn is not None:
            return
        missing: list[tuple[str, str, list[str]]] = []
        seen: set[int] = set()

        def visit(module: nn.Module, path: str, covered: bool) -> None:
            if id(module) in seen:
                return
            seen.add(id(module))
            covered = (covered or (self.ptm is not None and isinstance(module, self.ptm))
                       or _own_init(module) is not None)
            if not covered:
                # a tied parameter only counts at its home (first) module
                names = [a for a, t, is_param in _tensors_of(module)
                         if is_param and t.is_meta and self.by_orig[id(t)].home is module
                         and self.by_orig[id(t)].mode not in (_LOADED, _ELSEWHERE)]
                if names:
                    missing.append((path, type(module).__name__, names))
            for name, child in module._modules.items():
                if child is not None:
                    visit(child, join_path(path, name), covered)

        visit(self.model, "", False)
        if missing:
            where = [f"{p or '<root>'} ({cls}: {', '.join(n)})" for p, cls, n in missing]
            first_cls = missing[0][1]
            raise _error(
                f"{len(missing)} module(s) hold meta parameters but have no init code "
                "(no reset_parameters(), no transformers PreTrainedModel owner)",
                {"modules": where[:8] + (["..."] if len(where) > 8 else [])},
                "pass an init function: build(sch, param_init_fn=lambda module: ...), "
                f"or define reset_parameters() on {first_cls}",
                path=missing[0][0],
            )

    # ---------------------------------------------------------------- slots

    def _put(self, e: _Entry, tensor: torch.Tensor) -> None:
        for module, attr, is_param in e.slots:
            (module._parameters if is_param else module._buffers)[attr] = tensor

    def _home_tensor(self, e: _Entry) -> torch.Tensor | None:
        return (e.home._parameters if e.is_param else e.home._buffers).get(e.home_attr)

    def _set_rest(self, e: _Entry, tensor: torch.Tensor) -> None:
        old = _storage_key(e.rest) if e.rest is not None else None
        if old is not None and self.by_key.get(old) is e:
            del self.by_key[old]
        e.rest = tensor
        key = _storage_key(tensor)
        if key is not None:
            self.by_key[key] = e
        self._put(e, tensor)

    def _placeholder(self, e: _Entry, keep_hf_flag: bool = False) -> torch.Tensor:
        """A ``meta`` tensor of the full shape that looks like the original."""
        data = torch.empty(e.full_shape, dtype=e.orig.dtype, device="meta")
        if e.is_param:
            return _param_like(e.orig, data, keep_hf_flag=keep_hf_flag)
        return data

    def _final_like(self, e: _Entry, data: torch.Tensor) -> torch.Tensor:
        return _param_like(e.orig, data)

    def install_work(self) -> None:
        """Put each tensor's resting form in its slots: a full-shape meta placeholder for
        what is still to be made (so init code sees the full shape), the original
        otherwise."""
        for e in self.entries:
            if e.mode in (_NEW, _SCRATCH, _LOADED, _ELSEWHERE):
                self._set_rest(e, self._placeholder(e))
            else:
                if e.mode == _INPLACE and _HF_FLAG in e.orig.__dict__:
                    e.hf_flag = e.orig.__dict__.pop(_HF_FLAG)
                self._set_rest(e, e.orig)

    def rollback(self) -> None:
        for e in self.entries:
            self._put(e, e.orig)
            if e.hf_flag is not None:
                e.orig.__dict__[_HF_FLAG] = e.hf_flag
            e.local = None

    def _device_of(self, e: _Entry) -> torch.device:
        # meta tensors go to the build device; a real one being re-made stays put
        return self.device if e.orig.is_meta else e.orig.device

    # ---------------------------------------------------------------- one init call

    def pending(self, module: nn.Module) -> bool:
        """Whether ``module``'s subtree holds a tensor being initialised."""
        key = id(module)
        if key not in self._pending:
            self._pending[key] = False  # guards against cycles
            self._pending[key] = key in self._direct or any(
                self.pending(c) for c in module._modules.values() if c is not None)
        return self._pending[key]

    def _probe(self, sub_entries: list[_Entry], call: Callable[[], Any]
               ) -> tuple[dict[int, _Entry], set[int]]:
        """Run ``call`` on meta tensors only: which entries it touches, and which of them
        positionally. If the dry run fails, every entry of the subtree counts, positional."""
        swapped: list[_Entry] = []
        keys = dict(self.by_key)
        for e in sub_entries:
            rest = e.rest
            if rest is not None and not rest.is_meta:
                probe = _param_like(rest, torch.empty(
                    tuple(rest.shape), dtype=rest.dtype, device="meta"), keep_hf_flag=True) \
                    if isinstance(rest, nn.Parameter) else torch.empty(
                        tuple(rest.shape), dtype=rest.dtype, device="meta")
                self._put(e, probe)
                key = _storage_key(probe)
                if key is not None:
                    keys[key] = e
                swapped.append(e)
        watch = _Watch(keys, probe=True)
        ok = True
        try:
            with torch.random.fork_rng(devices=[]), watch:
                call()
        except Exception:  # anything the meta dry run cannot do: assume the worst
            ok = False
        finally:
            for e in swapped:
                assert e.rest is not None
                self._put(e, e.rest)
            for e in sub_entries:  # the dry run may have assigned new tensors
                if self._home_tensor(e) is not e.rest and e.rest is not None:
                    self._put(e, e.rest)
        if not ok:
            self.probe_fallbacks += 1
            touched = {id(e): e for e in sub_entries}
            return touched, set(touched)
        return watch.touched, watch.positional

    def _activate(self, e: _Entry, sub_ids: set[int], positional: bool) -> _Active:
        """Give ``e`` the form it has during one init call (see docs/design/build.md)."""
        if e.mode in (_LOADED, _ELSEWHERE):
            return _Active(e, None, "keep")  # its meta placeholder: writes do nothing
        device = self._device_of(e)
        if e.mode == _NEW and not e.split and e.local is None:
            e.local = self._final_like(e, _blank(e.full_shape, e.orig, device))
            self._set_rest(e, e.local)
        protected = e.mode in (_KEEP, _SCRATCH) or (
            e.initialising and e.initialised and id(e.home) not in sub_ids)
        if not e.split:
            if protected:
                assert e.rest is not None
                return _Active(e, None, "snapshot", saved=e.rest.detach().clone())
            return _Active(e, None, "keep")
        assert e.spec is not None
        known = e.orig if e.mode == _SCRATCH else e.local  # this rank's part so far
        if self.local_init and not positional:
            self._ensure_gen(e, device)
            if protected or known is None:
                data = (known.detach().clone() if known is not None
                        else _blank(e.spec.local_shape(), e.orig, device))
            else:
                data = known.detach()
            return _Active(e, self._wrap(e, data), "throwaway" if protected else "local",
                           routed=True)
        data = _blank(e.full_shape, e.orig, device)
        if known is not None:
            self._expand_into(e, data, known.detach())
        if protected:
            return _Active(e, self._wrap(e, data), "throwaway")
        had_nan = known is not None and _has_nan(known)
        e.local = None  # the full tensor holds it now
        return _Active(e, self._wrap(e, data), "slice", had_nan=had_nan,
                       expanded=known is not None)

    @staticmethod
    def _wrap(e: _Entry, data: torch.Tensor) -> torch.Tensor:
        return nn.Parameter(data, requires_grad=e.orig.requires_grad) if e.is_param else data

    @staticmethod
    def _expand_into(e: _Entry, full: torch.Tensor, local: torch.Tensor) -> None:
        """Put this rank's part ``local`` back at its place in ``full``."""
        assert e.spec is not None
        offset = 0
        for lo, hi in e.spec.ranges():
            full.narrow(e.spec.axis, lo, hi - lo).copy_(
                local.narrow(e.spec.axis, offset, hi - lo))
            offset += hi - lo

    def _ensure_gen(self, e: _Entry, device: torch.device) -> None:
        if e.gen is None:
            e.gen = torch.Generator(device=device)
            e.gen.manual_seed(_seed_of(e))

    def _settle(self, a: _Active, path: str) -> None:
        """After the call: keep what ``a.e`` should keep, free the full-size scratch."""
        e = a.e
        current = self._home_tensor(e)
        if a.kind == "snapshot":
            assert a.saved is not None and e.rest is not None
            e.rest.detach().copy_(a.saved)
            if current is not e.rest:
                self._put(e, e.rest)
            return
        if a.kind == "throwaway":
            self._put(e, e.rest)  # type: ignore[arg-type]
            return
        if a.kind == "keep":
            if e.initialising and current is not None and current is not e.rest:
                # the init code assigned a new tensor: take it
                if e.split:
                    self._take_slice(e, current.detach(), path)
                    self._put(e, e.rest)  # type: ignore[arg-type]
                else:
                    e.local = current
                    e.replaced = True
                    self._set_rest(e, current)
            elif current is not e.rest and e.rest is not None:
                self._put(e, e.rest)
            return
        assert a.tensor is not None
        source = (current if current is not None and current is not a.tensor
                  else a.tensor).detach()
        if a.kind == "local" and tuple(source.shape) == tuple(a.tensor.shape):
            e.local = source
        else:
            self._take_slice(e, source, path, check_nan=a.expanded and not a.had_nan)
        self._put(e, e.rest)  # type: ignore[arg-type]

    def _take_slice(self, e: _Entry, full: torch.Tensor, path: str,
                    check_nan: bool = False) -> None:
        assert e.spec is not None
        if tuple(full.shape) != e.full_shape:
            raise _error(
                f"the init code replaced {e.name!r} by a tensor of another shape",
                {"tensor": e.name, "shape": tuple(full.shape), "full_shape": e.full_shape},
                "initialise the tensor in place (module.weight.normal_(...)), or pass "
                "build(sch, param_init_fn=fn)", path=path)
        e.local = e.spec.slice(full).clone(memory_format=torch.contiguous_format)
        if check_nan and _has_nan(e.local):
            raise _error(
                f"the init code of {path or '<root>'} read the parts of {e.name!r} that "
                "other ranks keep (build holds only this rank's part between init calls, "
                "so they were NaN): its slice came out NaN",
                {"tensor": e.name, "module": path or "<root>"},
                "pass build(sch, param_init_fn=fn) with an init that writes the tensor "
                "without reading it", path=path)

    def _call(self, module: nn.Module, path: str, what: str, call: Callable[[], Any]) -> None:
        subtree = list(module.modules())
        sub_ids = {id(m) for m in subtree}
        sub_entries: dict[int, _Entry] = {}
        for m in subtree:
            for e in self.held.get(id(m), ()):
                sub_entries.setdefault(id(e), e)
        if self.fn is not None:
            # a user's function is not dry-run (it may count or log its calls): it gets
            # the module's own tensors, full size
            touched = {id(e): e for e in self.held.get(id(module), ())}
            positional = set(touched)
        else:
            touched, positional = self._probe(list(sub_entries.values()), call)
            # Some init functions return at once on a meta tensor (torch >= 2.13:
            # trunc_normal_, orthogonal_, dirac_, sparse_), so the dry run cannot see
            # them. The module's own tensors that are still to be initialised take part
            # in its call whatever the dry run saw (as position-dependent: full size).
            for e in self.held.get(id(module), ()):
                if e.initialising and not e.initialised and id(e) not in touched:
                    touched[id(e)] = e
                    positional.add(id(e))
        actives: list[_Active] = []
        route: dict[int, _Entry] = {}
        guard: dict[int, _Entry] = {}
        try:
            for key, e in touched.items():
                a = self._activate(e, sub_ids, key in positional)
                actives.append(a)
                if a.tensor is not None:
                    self._put(e, a.tensor)
                    if a.routed:
                        k = _storage_key(a.tensor)
                        if k is not None:
                            route[k] = e
            for k, e in self.by_key.items():
                if id(e) not in touched and e.mode not in (_LOADED, _ELSEWHERE) and (
                        e.mode == _KEEP or (e.rest is not None and e.rest.is_meta)):
                    guard[k] = e
            keys = dict(self.by_key)
            keys.update(route)
            watch = _Watch(keys, probe=False, guard=guard,
                           route={id(e): e for e in route.values()})
            fans = _full_fan_in(route) if route else contextlib.nullcontext()
            with watch, fans:
                call()
        except BuildError:
            raise
        except Exception as exc:
            raise _error(
                f"{what} of {type(module).__name__} raised {type(exc).__name__}: {exc}",
                {"module": path or "<root>", "init": what},
                "fix the init code, or pass build(sch, param_init_fn=...) to initialise "
                "this module yourself",
                path=path,
            ) from exc
        for a in actives:
            self._settle(a, path)
        for e in sub_entries.values():
            if id(e) not in touched:
                self._settle(_Active(e, None, "keep"), path)
            if id(e.home) in sub_ids:
                e.initialised = True

    def walk(self, module: nn.Module, path: str) -> None:
        if id(module) in self._visited:
            return
        self._visited.add(id(module))
        for name, child in module._modules.items():
            if child is not None:
                self.walk(child, join_path(path, name))
        if self.fn is not None:
            if id(module) in self._direct:
                fn = self.fn
                if self.fn_takes_path:
                    self._call(module, path, "param_init_fn", lambda: fn(module, path))
                else:
                    self._call(module, path, "param_init_fn", lambda: fn(module))
        elif self.ptm is not None and isinstance(module, self.ptm):
            self._hf_pass(module, module, path, set())
        else:
            reset = _own_init(module)
            if reset is not None and self.pending(module):
                self._call(module, path, f"{reset.__name__}()", reset)

    def _hf_pass(self, owner: nn.Module, module: nn.Module, path: str, seen: set[int]) -> None:
        seen.add(id(module))
        for name, child in module._modules.items():
            nested = isinstance(child, self.ptm)  # type: ignore[arg-type]
            if child is None or id(child) in seen or nested:
                continue
            self._hf_pass(owner, child, join_path(path, name), seen)
        if self.pending(module):
            init = owner._init_weights  # type: ignore[attr-defined]
            self._call(module, path, f"{type(owner).__name__}._init_weights", lambda: init(module))

    # ---------------------------------------------------------------- finish

    def finish(self) -> None:
        uninitialised: list[str] = []
        first_path = ""
        for e in self.entries:
            if e.mode != _NEW:
                continue
            if e.local is None:  # no init call ever touched it
                if e.is_param:
                    if not uninitialised:
                        first_path = e.name.rpartition(".")[0]
                    uninitialised.append(e.name)
                    continue
                shape = e.spec.local_shape() if e.split else e.full_shape  # type: ignore[union-attr]
                zeros = torch.zeros(shape, dtype=e.orig.dtype, device=self._device_of(e))
                e.local = zeros if e.split else self._final_like(e, zeros)
                continue
            if e.replaced:
                continue
            work = e.local.detach()
            if _has_nan(work):
                if e.is_param:
                    if not uninitialised:
                        first_path = e.name.rpartition(".")[0]
                    uninitialised.append(e.name)
                else:
                    work.masked_fill_(torch.isnan(work), 0)
        if uninitialised:
            raise _error(
                f"{len(uninitialised)} parameter(s) were not initialised by any init code "
                "(their module's reset_parameters() / _init_weights did not write them)",
                {"parameters": uninitialised[:8] + (["..."] if len(uninitialised) > 8 else [])},
                "pass an init function that covers them: build(sch, param_init_fn=fn), give "
                "their module a reset_parameters(), or (transformers) handle them in the "
                "model's _init_weights",
                path=first_path,
            )

    def load(self, plan: Any) -> None:
        """Read every ``weights=`` entry (this rank's part only), one tensor at a time."""
        for e in self.entries:
            if e.mode != _LOADED:
                continue
            spec = e.spec if e.split else None
            if e.orig.is_meta:
                shape = e.spec.local_shape() if e.split else e.full_shape  # type: ignore[union-attr]
                out = torch.empty(shape, dtype=e.orig.dtype, device=self.device)
            else:
                out = e.orig.detach()
            if e.located is not None:
                plan.read(e.located, spec, out)
            e.local = out

    def install_final(self) -> None:
        for e in self.entries:
            if e.mode in (_KEEP, _SCRATCH, _ELSEWHERE) or (
                    e.mode == _INPLACE and not e.replaced):
                final = e.orig
                if e.hf_flag is not None:
                    e.orig.__dict__[_HF_FLAG] = e.hf_flag
            elif e.mode == _LOADED:
                assert e.local is not None
                final = e.orig if not e.orig.is_meta else self._final_like(e, e.local)
            elif e.mode == _NEW and not e.split and not e.replaced:
                assert e.local is not None
                final = e.local  # created in its final form
            else:
                assert e.local is not None
                data = e.local.detach()
                if e.replaced and e.spec is not None and e.split is False:
                    data = e.spec.slice(data).clone(memory_format=torch.contiguous_format)
                final = self._final_like(e, data)
            self._put(e, final)
            e.rest = None
        self.by_key.clear()


def has_meta_tensors(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the ``meta`` device (a model
    made under :func:`~torchloom.init_empty_weights` that ``build`` has not filled)."""
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def _materialise(sch: Any, init_weights: Any, dev: torch.device,
                 param_init_fn: Callable[..., Any] | None, init: str,
                 weights: str | os.PathLike | None, strict: bool,
                 keep: set[int] | None = None) -> None:
    """Make every meta tensor real (init walk and/or ``weights``), one module at a time.
    With ``keep`` (ids of tensors; a pipeline rank's stages), meta tensors outside it
    stay on ``meta``: neither read nor initialised."""
    from . import weights as wts

    model = sch.mod
    builder = _Builder(model, bool(init_weights), dev, param_init_fn, init)
    builder.collect()
    source: Any = None
    plan: Any = None
    checkpoint_dir: str | None = None
    missing: list[str] = []
    if weights is not None:
        path = os.fspath(weights)
        by_id = {id(t.tensor): t for t in wts.model_keys(model)}
        covered: list[int] = []
        if wts.is_torchloom_checkpoint(path):
            checkpoint_dir = path
            covered = [key for key, t in by_id.items() if t.persistent]
        else:
            if keep is not None:
                builder.mark_elsewhere(keep)
            source = wts.open_weights(path, PRIMITIVE)
            try:
                plan = wts.WeightsPlan.for_module(model, source, primitive=PRIMITIVE)
                for e in builder.entries:
                    t = by_id.get(id(e.orig))
                    if t is None or not t.persistent:
                        continue
                    # every rank checks the whole model (a pipeline rank too), so that
                    # all ranks refuse a folder together
                    located = plan.locate(t, e.full_shape)
                    if located is None:
                        missing.append(e.name)
                    elif e.mode != _ELSEWHERE:
                        e.located = located
                        covered.append(id(e.orig))
                if strict:
                    wts.refuse_missing(missing, path, PRIMITIVE, source, plan.unexpected)
            except BaseException:
                source.close()
                raise
        builder.mark_loaded(covered)
    builder.finish_collect()
    try:
        if builder.needs_work():
            builder.check_shard_specs()
            builder.check_coverage()
            builder.install_work()
            try:
                with torch.no_grad():
                    builder.walk(model, "")
                    builder.finish()
                    builder.load(plan)
                    builder.install_final()
            except BaseException:
                builder.rollback()
                raise
    finally:
        if source is not None:
            source.close()
    if checkpoint_dir is not None:
        from .state import load

        load(model, None, checkpoint_dir, group=getattr(sch, "group", None))
    if weights is not None:
        wts.warn_missing(missing, os.fspath(weights), PRIMITIVE)
