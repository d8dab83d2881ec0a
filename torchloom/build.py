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

How a tensor is materialised:
    * it is allocated with its FULL shape (``shard_spec(t).full_shape`` for a sharded
      tensor) on ``device`` (default ``"cpu"``), with its dtype and ``requires_grad``;
      floating tensors are filled with NaN first, as a "never written" sentinel;
    * the init walk below initialises it;
    * a sharded tensor is then cut to the slice recorded in its shard spec,
      ``spec.slice(full)`` (``full.split(full_shape[axis] // world_size, axis)[rank]``, per
      block for a ``chunks > 1`` spec such as a fused q/k/v weight);
    * the new tensor keeps the old one's Parameter subclass, attributes, shard spec and
      ``annotate`` tags (:func:`torchloom.meta.copy_meta`); transformers'
      ``_is_hf_initialized`` flag is *not* carried over (it would make transformers' init
      functions skip the tensor);
    * it is placed in every ``_parameters`` / ``_buffers`` slot that held the old tensor,
      so tied weights (GPT-2 ``lm_head.weight is transformer.wte.weight``) stay one
      object.

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
then discarded. Protection costs a copy of the protected tensors under the module being
initialised (at the root of a model, all of them). A real sharded tensor is swapped for a
full-size scratch tensor during the walk, so the init draws for the full shape, and is
put back afterwards. With ``init_weights=True`` every tensor is re-initialised by the same
walk: unsharded real tensors in place (same objects), sharded ones full-size and sliced,
like meta ones.

After the walk, a parameter still holding the NaN sentinel was not (fully) initialised by
any init code: ``build`` raises :class:`~torchloom.errors.BuildError` naming it and puts
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
import inspect
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from .errors import BuildError
from .meta import _ATTR as _META_ATTR
from .meta import ShardSpec, copy_meta, shard_spec

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
_NEW = "new"          # was meta, or real-but-sharded under init_weights: fresh full tensor
_INPLACE = "inplace"  # real, unsharded, init_weights=True: initialised in place
_KEEP = "keep"        # real, init_weights=False: protected by snapshot / restore
_SCRATCH = "scratch"  # real sharded slice, init_weights=False: full scratch during the walk


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
    work: torch.Tensor | None = None
    initialised: bool = False
    replaced: bool = False
    hf_flag: Any = None

    @property
    def initialising(self) -> bool:
        return self.mode in (_NEW, _INPLACE)


def _error(problem: str, values: dict[str, Any], fix: str, path: str | None = "") -> BuildError:
    return BuildError(problem, path=path, primitive=PRIMITIVE, values=values, fix=fix)


# --------------------------------------------------------------------------- the builder


class _Builder:
    def __init__(self, model: nn.Module, init_weights: bool, device: torch.device,
                 param_init_fn: Callable[..., Any] | None) -> None:
        self.model = model
        self.init_weights = init_weights
        self.device = device
        self.fn = param_init_fn
        self.fn_takes_path = param_init_fn is not None and _accepts_path(param_init_fn)
        self.ptm = _pretrained_model_class()
        self.entries: list[_Entry] = []
        self.by_id: dict[int, _Entry] = {}    # by id of the tensor in the slots during the walk
        self.by_orig: dict[int, _Entry] = {}  # by id of the tensor before build
        self._pending: dict[int, bool] = {}
        self._direct: set[int] = set()
        self._visited: set[int] = set()

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
                if entry.initialising:
                    self._direct.add(id(module))

    def _mode_of(self, e: _Entry) -> str:
        sliced = e.spec is not None and tuple(e.spec.full_shape) != tuple(e.orig.shape)
        if e.orig.is_meta:
            return _NEW
        if self.init_weights:
            return _NEW if sliced else _INPLACE
        return _SCRATCH if sliced else _KEEP

    def check_shard_specs(self) -> None:
        for e in self.entries:
            if e.spec is None or e.mode not in (_NEW, _SCRATCH):
                continue
            spec = e.spec
            ok = (0 <= spec.axis < len(spec.full_shape) and spec.world_size >= 1
                  and 0 <= spec.rank < spec.world_size
                  and spec.full_shape[spec.axis] % (spec.world_size * spec.chunks) == 0
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
                         if is_param and t.is_meta and self.by_orig[id(t)].home is module]
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

    # ---------------------------------------------------------------- materialise

    def _fresh(self, e: _Entry, device: torch.device) -> torch.Tensor:
        shape = tuple(e.spec.full_shape) if e.spec is not None else tuple(e.orig.shape)
        dtype = e.orig.dtype
        if dtype.is_floating_point or dtype.is_complex:
            data = torch.full(shape, float("nan"), dtype=dtype, device=device)
        else:
            data = torch.zeros(shape, dtype=dtype, device=device)
        if e.spec is None and e.mode == _NEW:
            return _param_like(e.orig, data)
        if e.is_param:
            return nn.Parameter(data, requires_grad=e.orig.requires_grad)
        return data

    def install_work(self) -> None:
        for e in self.entries:
            if e.mode in (_NEW, _SCRATCH):
                # meta tensors go to the build device; a real one being re-made stays put
                e.work = self._fresh(e, self.device if e.orig.is_meta else e.orig.device)
            else:
                e.work = e.orig
                if e.mode == _INPLACE and _HF_FLAG in e.orig.__dict__:
                    e.hf_flag = e.orig.__dict__.pop(_HF_FLAG)
            self._put(e, e.work)
            self.by_id[id(e.work)] = e

    @staticmethod
    def _put(e: _Entry, tensor: torch.Tensor) -> None:
        for module, attr, is_param in e.slots:
            (module._parameters if is_param else module._buffers)[attr] = tensor

    def rollback(self) -> None:
        for e in self.entries:
            self._put(e, e.orig)
            if e.hf_flag is not None:
                e.orig.__dict__[_HF_FLAG] = e.hf_flag

    # ---------------------------------------------------------------- the walk

    def pending(self, module: nn.Module) -> bool:
        """Whether ``module``'s subtree holds a tensor being initialised."""
        key = id(module)
        if key not in self._pending:
            self._pending[key] = False  # guards against cycles
            self._pending[key] = key in self._direct or any(
                self.pending(c) for c in module._modules.values() if c is not None)
        return self._pending[key]

    def _call(self, module: nn.Module, path: str, what: str, call: Callable[[], Any]) -> None:
        subtree = list(module.modules())
        sub_ids = {id(m) for m in subtree}
        protected: list[tuple[torch.Tensor, torch.Tensor]] = []
        seen: set[int] = set()
        for m in subtree:
            for _, t, _ in _tensors_of(m):
                if id(t) in seen:
                    continue
                seen.add(id(t))
                e = self.by_id.get(id(t))
                if e is None:
                    continue
                if e.mode == _KEEP or (e.initialised and id(e.home) not in sub_ids
                                       and e.mode != _SCRATCH):
                    protected.append((t, t.detach().clone()))
        try:
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
        for t, saved in protected:
            t.detach().copy_(saved)
        for m in subtree:
            for _, t, _ in _tensors_of(m):
                e = self.by_id.get(id(t))
                if e is not None and id(e.home) in sub_ids:
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
            current = (e.home._parameters if e.is_param else e.home._buffers).get(e.home_attr)
            if current is not None and current is not e.work and e.mode in (_NEW, _INPLACE):
                e.work = current  # the init code assigned a new tensor: take it
                e.replaced = True
            if e.mode == _NEW and not e.replaced:
                work = e.work
                assert work is not None
                if work.dtype.is_floating_point or work.dtype.is_complex:
                    nan = torch.isnan(work.detach())
                    if bool(nan.any()):
                        if e.is_param:
                            if not uninitialised:
                                first_path = e.name.rpartition(".")[0]
                            uninitialised.append(e.name)
                        else:
                            work.detach().masked_fill_(nan, 0)
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

    def install_final(self) -> None:
        for e in self.entries:
            work = e.work
            assert work is not None
            if e.mode in (_KEEP, _SCRATCH) or (e.mode == _INPLACE and not e.replaced):
                final = e.orig
                if e.hf_flag is not None:
                    e.orig.__dict__[_HF_FLAG] = e.hf_flag
            elif e.mode == _NEW and e.spec is None and not e.replaced:
                final = work  # created in its final form by _fresh
            else:
                data = work.detach()
                if e.spec is not None:
                    data = e.spec.slice(data).clone(memory_format=torch.contiguous_format)
                final = _param_like(e.orig, data)
            self._put(e, final)


# --------------------------------------------------------------------------- build


def _check_schedule(sch: Any) -> None:
    from .schedule import Schedule  # late: schedule imports the primitives

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
) -> tuple[Any, torch.optim.Optimizer | None]:
    """Materialise and return the scheduled model, and optionally its optimizer.

    Args:
        sch: the root schedule (``torchloom.create_schedule(model)``).
        target: the form of the result: None (the scheduled module itself), ``"ddp"``
            (``DistributedDataParallel`` on the data-parallel ranks) or ``"fsdp"`` (FSDP2
            ``fully_shard`` of each layer and the root); see :mod:`torchloom.parallel`;
            ``"pipeline"``: the stages cut by ``cut_pipeline_stage`` run by
            ``torch.distributed.pipelining`` (a :class:`torchloom.pipeline.PipelineModel`
            holding this rank's stages); see :mod:`torchloom.pipeline`.
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
        mesh: for ``"ddp"`` / ``"fsdp"``, a mesh from :func:`torchloom.parallel.init_mesh`
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

    Returns:
        ``(model, optimizer)``: ``model`` is ``sch.mod`` (changed in place; wrapped in
        ``DistributedDataParallel`` for ``"ddp"``), ``optimizer`` is what the factory
        returned, or None.

    Raises:
        BuildError: on a bad argument, a module with meta parameters and no init code, init
            code that fails or leaves a parameter uninitialised (the model's meta tensors
            are then put back), or a tensor whose shape does not match its shard spec.

    See the module docstring for the init order and what is kept.
    """
    _check_schedule(sch)
    _check_target(target)
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

    model = sch.mod
    builder = _Builder(model, bool(init_weights), dev, param_init_fn)
    builder.collect()
    if builder.needs_work():
        builder.check_shard_specs()
        builder.check_coverage()
        builder.install_work()
        try:
            with torch.no_grad():
                builder.walk(model, "")
                builder.finish()
                builder.install_final()
        except BaseException:
            builder.rollback()
            raise

    # Data-parallel wrapping comes last (after materialisation); FSDP2 replaces the
    # parameters, so the optimizer is made after it.
    from .parallel import wrap_data_parallel

    if target == "pipeline":
        from .pipeline import build_pipeline

        names = getattr(mesh, "mesh_dim_names", None) or ()
        pp_group = mesh["pp"].get_group() if "pp" in names else (
            mesh.get_group() if mesh is not None else None)
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
    return model, opt
