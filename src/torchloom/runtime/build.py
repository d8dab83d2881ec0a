"""``build``: turn a schedule into a trainable model, materialising delayed weights.

A large model is best scheduled *before* its weights exist: construct it under
:func:`init_empty_weights` (every parameter lands on the ``meta`` device, nothing is
allocated), apply primitives (``shard`` slices meta tensors for free), then call
:func:`build`, which materialises every meta tensor on a real device and initialises it
with the model's own init code. The result equals initialising the full model and then
slicing each sharded tensor, without ever holding the whole model at once in between.

Preconditions:
    * ``sch`` is the root :class:`~torchloom.Schedule` (``sch.root``), not a child node;
    * ``target`` is None (the only target of this version);
    * every module that holds a meta *parameter* can be initialised: it (or an ancestor)
      defines ``reset_parameters()``, or it sits inside a transformers ``PreTrainedModel``
      whose ``_init_weights`` covers it, or ``param_init_fn`` is given;
    * an optimizer is passed as a *factory* ``params -> Optimizer``, never as an
      instance: an optimizer made before ``build`` holds the meta parameters, which
      ``build`` replaces by new ones, so it would train nothing.

Before / after:

>>> import torch, torchloom as tl
>>> from torch import nn
>>> with tl.init_empty_weights():
...     model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
>>> model[0].weight.device
device(type='meta')
>>> sch = tl.create_schedule(model)
>>> sch["0"].shard("weight", 0)
>>> _ = torch.manual_seed(0)
>>> built, opt = tl.build(sch, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
>>> built is model, built[0].weight.device, tl.shard_spec(built[0].weight).full_shape
(True, device(type='cpu'), (8, 4))
>>> _ = torch.manual_seed(0)
>>> eager = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
>>> torch.equal(built[0].weight, eager[0].weight), len(opt.param_groups[0]["params"])
(True, 4)

How a tensor is materialised (one module at a time). A rank's peak memory is its own
shard plus the full-size tensors that ONE init call needs, never the whole model:

    * between init calls a tensor still to be made sits in its slots as a ``meta``
      placeholder of its FULL shape (``shard_spec(t).full_shape``), so init code sees the
      shapes it would see unsharded; what is already made is kept at this rank's size;
    * before each init call (one ``reset_parameters()``, ``_init_weights(module)`` or
      ``param_init_fn(module)``), a *dry run* of the same call on ``meta`` tensors (nothing
      written, allocated or drawn) finds the tensors it touches: its own, and those of
      other modules it writes (GPT-2's attention re-draws its ``c_proj.weight``, T5's
      model re-draws ``shared.weight``). Only those get a real full-size tensor on
      ``device`` (default ``"cpu"``), NaN-filled when floating (the "never written"
      sentinel), holding this rank's part from earlier calls at its place;
    * right after the call a sharded tensor is cut to this rank's slice,
      ``spec.slice(full)`` (per block for a ``chunks > 1`` spec such as a fused q/k/v
      weight), and the full-size tensor is freed; an unsharded one is made once, in its
      final form, and written in place by later calls;
    * init code that the dry run cannot run (it reads a value, ``.item()``) gets every
      tensor of its module's subtree at full size (correct, more memory); a touch the
      dry run did not foresee is a :class:`~torchloom.core.errors.BuildError`; an init that
      reads the parts of a sharded tensor other ranks keep after an earlier call made it
      (they are NaN then) is a BuildError naming the tensor; a ``param_init_fn`` is not
      dry-run (it may count its calls): it gets its module's own tensors at full size;
    * the new tensor keeps the old one's Parameter subclass, attributes, gradient hooks,
      shard spec and ``annotate`` tags (:func:`torchloom.core.meta.copy_meta`); transformers'
      ``_is_hf_initialized`` flag is *not* carried over (it would make transformers' init
      functions skip the tensor);
    * it is placed in every ``_parameters`` / ``_buffers`` slot that held the old tensor,
      so tied weights (GPT-2 ``lm_head.weight is transformer.wte.weight``) stay one
      object.

The order and the values of the random draws do not change: every init call runs as on
the whole model, on full-size tensors, and only what other ranks keep is dropped. For the
1.68 B-parameter Llama of ``benchmarks/scale_bench.py`` at TP=8, a rank's build peaks at
1.82 GiB of anonymous memory above its start for a 1.64 GiB shard (6.93 GiB, the whole
model, before).

``init="local"``: each rank draws only its own slices, from its own stream (fast: a rank
does about ``1/world_size`` of the sharded draws; not the values of ``init="full"``):

    * a sharded tensor whose init call uses only element-wise operators on it (``normal_``,
      ``uniform_``, ``fill_``, ``zero_``, ``mul_``, ``trunc_normal_``'s steps, casts) gets a
      tensor of this rank's shape, and its random draws come from a generator seeded
      from ``torch.initial_seed()``, the shard's rank and the tensor's name (the same
      seed gives the same values; two ranks' slices are independent draws);
    * fan-in based inits (``kaiming_*``, ``xavier_*``, ``nn.Linear``'s bias bound) compute
      their fan-in and fan-out from the FULL shape (``torch.nn.init`` is told the full
      shape of a local slice), so the bound is the unsharded one;
    * an init call that indexes the tensor or otherwise depends on positions (the
      padding row of an ``nn.Embedding``, ``orthogonal_``, ``eye_``, a copy from a
      full-shape tensor) runs as in ``init="full"`` on a full-size tensor, drawing from
      the shared default generator, so that slice has the unsharded init's values;
    * unsharded (replicated) tensors are drawn from the default generator in the same
      order on every rank, so replicas agree;
    * not covered: init code that derives its statistics from a sharded tensor's shape
      by other means than ``torch.nn.init``'s fan computation (e.g.
      ``std = 1 / math.sqrt(w.shape[1])``) sees the local shape there.

``weights=PATH`` (see :mod:`torchloom.runtime.weights`): the tensors the files hold are read, this
rank's part only, after the init walk; during the walk their slots hold meta placeholders,
so an init call that writes them does nothing (no draw, no full-size scratch) and init
calls of modules whose tensors all come from the files are skipped.

Init order (the "init walk"). Random draws should follow the order of eager construction,
so that, for the same seed, delayed init gives the same weights as eager construction
wherever the model's init code makes that possible. Modules are walked recursively, each
shared module once, children in registration order:

    * a plain module first walks its children, then calls its own ``reset_parameters()``
      (if it defines one and its subtree holds a tensor being initialised;
      ``nn.MultiheadAttention`` and ``nn.Transformer`` use their ``_reset_parameters()``).
      Children come first because that is what eager construction does: a constructor builds its
      children (each drawing in its own constructor) and calls ``reset_parameters()`` at
      its end, and a parent's ``reset_parameters`` that re-initialises its children must
      run after theirs;
    * a transformers ``PreTrainedModel`` first walks its children the same way (plain
      children replay their constructor draws through ``reset_parameters``; a nested
      ``PreTrainedModel`` runs its own complete walk, as its constructor's ``post_init``
      does), then runs its init pass: ``self._init_weights(module)`` on every module of
      its subtree, children before parents (the post-order of
      ``PreTrainedModel.initialize_weights`` / ``smart_apply``), skipping the subtrees of
      nested pretrained models (already handled: in eager construction their
      ``_is_hf_initialized`` flags make the outer pass skip them) and modules whose subtree
      holds no tensor being initialised. ``_init_weights`` is called directly: module
      flags are ignored;
    * with ``param_init_fn``, it replaces all of the above: it is called, children before
      parents, on every module that directly holds a tensor being initialised, as
      ``param_init_fn(module)`` or ``param_init_fn(module, path)`` (chosen by whether the
      function accepts two positional arguments). The tensors are already materialised
      (full shape, NaN-filled) and must be initialised in place.

"A tensor being initialised" is one that was on ``meta`` when ``build`` started, or, with
``init_weights=True``, any tensor.

What is never overwritten. With ``init_weights=False`` (the default) a tensor that was
already real when ``build`` started keeps its values: when an init call on a module
would touch one (its own, or one of a sub-module: GPT-2's ``GPT2Attention`` re-draws its
``c_proj.weight``), those tensors are copied before the call and copied back after it.
The call still runs, so the random draws are the ones eager construction made. The same
protection applies to a tied tensor reached through an alias after its home module (the
first module holding it, in ``named_modules()`` order) has initialised it: GPT-2's
``lm_head.reset_parameters()`` draws, but the result is discarded and ``wte`` keeps its
values, just as eager construction drew into a separate ``lm_head.weight`` that tying
then discarded. Protection costs a copy of the protected tensors the call touches. A
real sharded tensor gets a throwaway full-size tensor (holding its slice) for each call
that touches it, so the init draws for the full shape, and is put back afterwards. With ``init_weights=True`` every tensor is re-initialised by the same
walk: unsharded real tensors in place (same objects), sharded ones full-size and sliced,
like meta ones.

After the walk, a parameter still holding the NaN sentinel was not (fully) initialised by
any init code: ``build`` raises :class:`~torchloom.core.errors.BuildError` naming it and puts
every meta tensor back. A buffer left unwritten (no ``_init_weights`` case for it; with
``init_empty_weights(include_buffers=True)``) is zero-filled: transformers'
``_init_weights`` recomputes the usual ones (rotary ``inv_freq``, BERT ``position_ids``),
anything else comes back as zeros, not as its constructor value.

Delayed init vs. eager construction, for the same seed. For modules whose constructor
draws only through ``reset_parameters()`` (``nn.Linear``, ``nn.Embedding``, norms, ...)
the walk replays the constructor draws exactly, so a plain torch model, and transformers
BERT and Llama models, come out bitwise equal to eager construction (checked in
``tests/test_build.py``). GPT-2 does not: transformers' ``Conv1D`` draws
``nn.init.normal_(self.weight)`` directly in its ``__init__`` and has no
``reset_parameters``, so those constructor draws cannot be replayed; every later draw
(the whole ``post_init`` pass) then starts from a different generator state. The
weights have the same distribution, just not the same values. (Giving ``Conv1D`` a
``reset_parameters`` that makes the same draw restores bitwise equality; the test does
that to prove the reason.) In general, a constructor draw that is not made through
``reset_parameters`` (``nn.Parameter(torch.randn(...))``, an init call in ``__init__``)
is not replayed; note that such a ``torch.randn`` still runs during
:func:`init_empty_weights` (on CPU, before the parameter is moved to ``meta``). Modules
made by deep-copying a drawn module (``nn.TransformerEncoder`` clones its layer) drew once
in eager construction; the walk draws for every copy.
For a model constructed entirely under :func:`init_empty_weights`, ``build(meta_model)``
equals ``build(eager_model, init_weights=True)`` under the same seed for any model, as
both run the same walk.
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

__all__ = ["build", "init_empty_weights", "SUPPORTED_TARGETS", "PLANNED_TARGETS"]

PRIMITIVE = "build"
SUPPORTED_TARGETS: tuple[str | None, ...] = (None, "ddp", "fsdp", "pipeline")
PLANNED_TARGETS: tuple[str, ...] = ("deepspeed",)

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


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


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
                    entry = _Entry(orig=tensor, name=_join(path, attr), home=module,
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
                    visit(child, _join(path, name), covered)

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
        """Give ``e`` the form it has during one init call (see the module docstring)."""
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
                self.walk(child, _join(path, name))
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
            self._hf_pass(owner, child, _join(path, name), seen)
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


# --------------------------------------------------------------------------- build


def has_meta_tensors(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the ``meta`` device (a model
    made under :func:`~torchloom.init_empty_weights` that ``build`` has not filled)."""
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def _check_schedule(sch: Any) -> None:
    from ..core.schedule import Schedule

    if not isinstance(sch, Schedule):
        raise _error(
            f"build takes the root schedule, not a {type(sch).__name__}",
            {"sch": type(sch).__name__},
            "make a schedule first: sch = torchloom.create_schedule(model); "
            "model, opt = torchloom.build(sch)",
            path=None,
        )
    if sch.parent is not None:
        raise _error(
            "build takes the root schedule, not a child node",
            {"path": sch.path},
            "pass the root schedule: torchloom.build(sch.root)",
            path=sch.path,
        )


def _check_rebuild(sch: Any, rebuild: Any) -> None:
    """``build`` once per schedule, unless ``rebuild=True`` (see :func:`build`)."""
    if not isinstance(rebuild, bool):
        raise _error(f"rebuild must be True or False, not {rebuild!r}", {"rebuild": rebuild},
                     "torchloom.build(sch, rebuild=True)")
    if not sch._built:
        return
    if not rebuild:
        raise _error(
            "this schedule was already built; a second build would make a second optimizer "
            "(and wrapper) over the same parameters while the first ones stay in use",
            {"built_for_target": sch._built_target},
            "use the model and optimizer the first build returned; to build again on "
            "purpose (a new optimizer or target): torchloom.build(sch, rebuild=True, ...)",
        )
    if sch._built_target == "fsdp":
        raise _error(
            "a schedule built for FSDP cannot be rebuilt: fully_shard replaced its "
            "parameters by sharded DTensors in place",
            {"built_for_target": sch._built_target},
            "build a fresh model: sch = torchloom.apply_recipe(make_model(), sch.recipe); "
            "torchloom.build(sch, target='fsdp', ...)",
        )


# Primitives whose effect exists only in training mode.
_TRAINING_ONLY = ("checkpoint", "fork_rng")


def _warn_eval_mode(sch: Any) -> None:
    """One UserWarning when modules that ``checkpoint`` / ``fork_rng`` act on are in eval
    mode (``from_pretrained`` returns an eval-mode model): those primitives do nothing
    there until ``model.train()``."""
    import warnings

    idle: list[str] = []
    for entry in sch.recipe:
        if entry.primitive not in _TRAINING_ONLY or entry.path in idle:
            continue
        try:
            module = sch.mod.get_submodule(entry.path)
        except AttributeError:
            continue
        if not module.training:
            idle.append(entry.path)
    if idle:
        shown = ", ".join(repr(p) for p in idle[:4]) + (", ..." if len(idle) > 4 else "")
        warnings.warn(
            f"build: the model is in eval mode, so checkpoint / fork_rng at {shown} do "
            "nothing (no recomputation, no forked dropout) until you call model.train(); "
            "from_pretrained returns an eval-mode model. fix: model.train() before "
            "training (build keeps the mode it was given)",
            UserWarning,
            stacklevel=3,
        )


def _check_target(target: Any) -> None:
    if target in SUPPORTED_TARGETS:
        return
    planned = isinstance(target, str) and target.lower() in PLANNED_TARGETS
    problem = (f"target {target!r} is not available in this version" if planned
               else f"unknown build target {target!r}")
    raise _error(
        problem,
        {"target": target, "supported": list(SUPPORTED_TARGETS),
         "planned": list(PLANNED_TARGETS)},
        "build the scheduled module itself with target=None: model, opt = "
        "torchloom.build(sch), then wrap it yourself if needed",
    )


def _check_weights_args(init: Any, weights: Any, strict: Any) -> None:
    if init not in INIT_MODES:
        raise _error(f"unknown init mode {init!r}", {"init": init, "modes": list(INIT_MODES)},
                     "build(sch, init='full') (values of an unsharded init, sliced) or "
                     "build(sch, init='local') (each rank draws only its slices)")
    if weights is not None and not isinstance(weights, (str, os.PathLike)):
        raise _error(f"weights must be a folder path, not a {type(weights).__name__}",
                     {"weights": type(weights).__name__},
                     "build(sch, weights='path/to/save_pretrained/folder')")
    if not isinstance(strict, bool):
        raise _error(f"strict must be True or False, not {strict!r}", {"strict": strict},
                     "build(sch, weights=path, strict=True)")


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
                    if t is None or not t.persistent or e.mode == _ELSEWHERE:
                        continue
                    e.located = plan.locate(t, e.full_shape)
                    if e.located is not None:
                        covered.append(id(e.orig))
                    else:
                        missing.append(e.name)
                if strict:
                    wts.refuse_missing(missing, path, PRIMITIVE)
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


def build(
    sch: Any,
    target: str | None = None,
    init_weights: bool = False,
    param_init_fn: Callable[..., Any] | None = None,
    optimizer: Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer] | None = None,
    *,
    device: str | torch.device = "cpu",
    mesh: Any = None,
    fsdp_units: list[str] | None = None,
    schedule: str = "1F1B",
    n_microbatches: int = 4,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    example_inputs: tuple | dict | None = None,
    rebuild: bool = False,
    weights: str | os.PathLike | None = None,
    init: str = "full",
    strict: bool = False,
) -> tuple[Any, torch.optim.Optimizer | None]:
    """Materialise and return the scheduled model, and optionally its optimizer.

    Args:
        sch: the root schedule (``torchloom.create_schedule(model)``).
        target: the form of the result: None (the scheduled module itself), ``"ddp"``
            (``DistributedDataParallel`` on the data-parallel ranks) or ``"fsdp"`` (FSDP2
            ``fully_shard`` of each layer and the root); see :mod:`torchloom.runtime.parallel`;
            ``"pipeline"``: the stages cut by ``cut_pipeline_stage`` run by
            ``torch.distributed.pipelining`` (a :class:`torchloom.runtime.pipeline.PipelineModel`
            holding this rank's stages); see :mod:`torchloom.runtime.pipeline`.
            ``"deepspeed"`` is planned.
        init_weights: also re-initialise tensors that are already real (by default they
            keep their values; only ``meta`` tensors are initialised).
        param_init_fn: initialise modules with this instead of their own init code; called
            as ``fn(module)`` or ``fn(module, path)`` on every module that directly holds a
            tensor being initialised, children first.
        optimizer: a factory ``params -> Optimizer``, called on the materialised
            ``model.parameters()`` (tied weights appear once). It must be a factory: an
            optimizer created before ``build`` would hold the meta parameters that
            ``build`` replaces.
        device: where meta tensors are materialised (real tensors are not moved).
        mesh: for ``"ddp"`` / ``"fsdp"``, a mesh from :func:`torchloom.runtime.parallel.init_mesh`
            (its ``"dp"`` dimension is used) or a 1-D data-parallel mesh; None: all ranks of
            the default group are data-parallel ranks.
        fsdp_units: for ``"fsdp"``, the module paths (wildcards allowed) sharded as units
            before the root; default: every item of every ``ModuleList``.
        schedule, n_microbatches, loss_fn, example_inputs: for ``"pipeline"``: the
            schedule (``"GPipe"``, ``"1F1B"``, ``"Interleaved1F1B"``), the micro-batches
            per step, ``loss_fn(output, target)`` on the last stage, and one example
            micro-batch (what crosses between stages is sized on it). The pipeline runs
            on the ``"pp"`` dimension of ``mesh`` (or all ranks); the schedule is
            checked for deadlocks with PyTorch's simulator before anything runs.
        rebuild: a schedule is built once; a second ``build`` raises unless
            ``rebuild=True``. A rebuild runs build again on the same, already built
            model: the argument checks and the agreement across ranks, the
            materialisation of any tensor still on ``meta`` (none after a first build;
            with ``init_weights=True`` every tensor is initialised again, as in a first
            build), a new wrapper for ``target`` around ``sch.mod`` and a new optimizer
            from the factory. It does not undo, re-apply or replay primitives (the model
            keeps its shards, syncs and replacements, and primitives stay refused after
            build), does not unwrap or stop the previous wrapper (drop it), does not
            carry the previous optimizer's state over (the old optimizer still holds the
            same parameter objects unless they were re-initialised), and is refused
            after a ``target="fsdp"`` build (FSDP2 shards the parameters in place).
        weights: a local Hugging Face folder (``model.safetensors``, a sharded
            ``model.safetensors.index.json``, or ``pytorch_model.bin`` read with
            ``weights_only=True``) or a torchloom checkpoint directory
            (:func:`torchloom.runtime.state.save`). Each rank reads only the slices it keeps, cast
            to the dtype of the model's tensor; what the files hold is never initialised
            (no draws, no full-size scratch); what they lack is initialised as usual and
            listed in one warning. Real tensors the files hold are overwritten. See
            :mod:`torchloom.runtime.weights` (key renames as transformers' ``from_pretrained``).
            With ``target="pipeline"`` and a model with ``meta`` tensors, the model is
            split first (on fake values) and each rank reads and materialises only the
            tensors of its own stages; the other stages' tensors stay on ``meta`` in
            ``sch.mod``. (Without ``weights``, a pipeline build initialises the whole
            model on every rank, so that every rank draws the same values, tied weights
            included, and keeps its stages.)
        init: ``"full"`` (default): the values equal initialising the whole model and
            slicing (see "Init order"); ``"local"``: each rank draws only its own slices,
            from a per-shard stream (see "init='local'"): faster, the same
            distribution, not the same values.
        strict: with ``weights``, a tensor the files lack is a
            :class:`~torchloom.runtime.state.CheckpointMismatchError` instead of a warning.

    Returns:
        ``(model, optimizer)``: ``model`` is ``sch.mod`` (changed in place; wrapped in
        ``DistributedDataParallel`` for ``"ddp"``), ``optimizer`` is what the factory
        returned, or None.

    Raises:
        BuildError: on a bad argument, a module with meta parameters and no init code, init
            code that fails or leaves a parameter uninitialised (the model's meta tensors
            are then put back), or a tensor whose shape does not match its shard spec; a
            schedule built before (without ``rebuild=True``); an optimizer factory that
            does not return a ``torch.optim.Optimizer``.
        ScheduleMismatchError: on every rank, when the ranks of the schedule's group
            scheduled differently (another recipe line, or other local parameter
            shapes); see :mod:`torchloom.runtime.agree`. Checked before anything is
            materialised, with one small all-gather.
        CheckpointMismatchError: ``weights`` holds a tensor of another shape (the key, the
            file and both shapes are named), a fused tensor's parts only in part, a tensor
            transformers would convert, or (``strict=True``) lacks a tensor of the model.
        CheckpointIOError: ``weights`` is not a weights folder or a file is unreadable.

    Warns:
        UserWarning: once per call, when modules that ``checkpoint`` or ``fork_rng`` act on
            are in eval mode (``from_pretrained`` returns an eval-mode model): call
            ``model.train()``; build does not change the mode.

    See the module docstring for the init order and what is kept.
    """
    _check_schedule(sch)
    _check_target(target)
    _check_rebuild(sch, rebuild)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise _error(f"{device!r} is not a device: {exc}", {"device": device},
                     "pass a device such as device='cpu' or device='cuda:0'") from exc
    if dev.type == "meta":
        raise _error("cannot materialise onto the meta device", {"device": str(dev)},
                     "pass a real device, e.g. device='cpu'")
    if param_init_fn is not None and not callable(param_init_fn):
        raise _error(
            f"param_init_fn must be callable, not a {type(param_init_fn).__name__}",
            {"param_init_fn": param_init_fn},
            "pass a function: build(sch, param_init_fn=lambda module: module.reset_parameters())",
        )
    if isinstance(optimizer, torch.optim.Optimizer) or (
            optimizer is not None and not callable(optimizer)):
        raise _error(
            "optimizer must be a factory params -> Optimizer, not an optimizer instance: one "
            "made before build holds the meta parameters that build replaces",
            {"optimizer": type(optimizer).__name__},
            "build(sch, optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4))",
        )
    _check_weights_args(init, weights, strict)
    _warn_eval_mode(sch)
    # Every rank of the group scheduled the same way (one small all-gather), checked
    # before anything is materialised or wrapped.
    from .agree import check_ranks_agree

    check_ranks_agree(sch, primitive=PRIMITIVE)

    pp_group = None
    keep: set[int] | None = None
    if target == "pipeline":
        from .pipeline import local_stage_tensors

        names = getattr(mesh, "mesh_dim_names", None) or ()
        pp_group = mesh["pp"].get_group() if "pp" in names else (
            mesh.get_group() if mesh is not None else None)
        if weights is not None and has_meta_tensors(sch.mod):
            # read only this rank's stages from the files: split the (meta) model first
            keep = local_stage_tensors(sch, schedule=schedule, example_inputs=example_inputs,
                                       loss_fn=loss_fn, group=pp_group)
    _materialise(sch, init_weights, dev, param_init_fn, init, weights, strict, keep)
    model = sch.mod

    # Data-parallel wrapping comes last (after materialisation); FSDP2 replaces the
    # parameters, so the optimizer is made after it.
    from .parallel import wrap_data_parallel

    if target == "pipeline":
        from .pipeline import build_pipeline

        model = build_pipeline(sch, schedule=schedule, n_microbatches=n_microbatches,
                               loss_fn=loss_fn, example_inputs=example_inputs, group=pp_group,
                               device=dev)
    else:
        model = wrap_data_parallel(model, target, mesh, fsdp_units)
    opt = None
    if optimizer is not None:
        try:
            opt = optimizer(model.parameters())
        except Exception as exc:
            raise _error(
                f"the optimizer factory raised {type(exc).__name__}: {exc}",
                {"optimizer": getattr(optimizer, "__name__", type(optimizer).__name__)},
                "pass a factory that takes the parameters, e.g. "
                "optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4)",
            ) from exc
        if not isinstance(opt, torch.optim.Optimizer):
            raise _error(
                f"the optimizer factory returned a {type(opt).__name__}, not a "
                "torch.optim.Optimizer",
                {"optimizer": getattr(optimizer, "__name__", type(optimizer).__name__),
                 "returned": type(opt).__name__},
                "return the optimizer made from the parameters: "
                "optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4)",
            )
    # primitives and a second build are refused from now on
    sch._built, sch._built_target = True, target
    return model, opt
