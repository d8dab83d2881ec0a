"""Materialisation: a model's ``meta`` (delayed) tensors made real, one module at a time.

Construct a model under :func:`init_empty_weights` (its parameters land on ``meta``,
nothing is allocated); :func:`torchloom.build` then calls :func:`_materialise`, which runs
the model's own init code (``reset_parameters``, transformers' ``_init_weights``, or
``param_init_fn``) in eager-construction order and/or reads ``weights=``, keeping only
this rank's slice of each sharded tensor. Design (memory, init order, ``init="local"``,
what is never overwritten): ``docs/design/build.md``.

This module is the builder and :func:`_materialise`; :func:`init_empty_weights` and
:func:`has_meta_tensors` live in :mod:`torchloom.runtime.empty_init` (importable from
here), what the builder knows of each tensor in :mod:`torchloom.runtime.init_watch`.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterable, cast

import torch
from torch import nn

from ..core.errors import BuildError
from ..core.meta import shard_spec
from ..core.schedule import join_path
from .empty_init import _HF_FLAG, _param_like, has_meta_tensors, init_empty_weights
from .init_watch import (
    _ELSEWHERE,
    _INPLACE,
    _KEEP,
    _LOADED,
    _NEW,
    _SCRATCH,
    INIT_MODES,
    PRIMITIVE,
    _accepts_path,
    _Active,
    _blank,
    _Entry,
    _error,
    _full_fan_in,
    _has_nan,
    _own_init,
    _pretrained_model_class,
    _seed_of,
    _storage_key,
    _tensors_of,
    _Watch,
)

# The builder is in layers: empty_init (meta tensors, _param_like) < init_watch (the
# entries and the dispatch mode) < materialise (the builder, _materialise).
__all__ = ["init_empty_weights", "has_meta_tensors", "INIT_MODES"]


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
            slots: dict[str, Any] = module._parameters if is_param else module._buffers
            slots[attr] = tensor

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
            # owner is a transformers PreTrainedModel (self.ptm)
            init = cast(Callable[[nn.Module], Any], owner._init_weights)
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


def _is_adapter(tensor: torch.Tensor) -> bool:
    """A LoRA adapter the ``lora`` primitive made (real, initialised)."""
    from ..core.meta import get_meta, has_meta
    from .adapters import TAG

    return not tensor.is_meta and has_meta(tensor) and bool(get_meta(tensor).tags.get(TAG))


def _whole_checkpoint(path: str, group: Any) -> Any:
    """The checkpoint ``build(weights=path)`` reads every tensor from (verified, as
    ``torchloom.load`` finds it); one that holds only the tensors that trained (a LoRA
    run's adapters, ``save(trainable_only=True)``) is refused: the rest of the model
    would be left uninitialised."""
    from ..core.errors import CheckpointMismatchError
    from .state import find_checkpoint

    ckpt = find_checkpoint(path, group=group)
    if ckpt.marker.get("trainable_only") is True:
        raise CheckpointMismatchError(
            "the checkpoint holds only the tensors that trained (a LoRA run's adapters, "
            "saved with trainable_only=True), not the model's other weights, which build "
            "would leave uninitialised", primitive=PRIMITIVE,
            values={"path": ckpt.path, "step": ckpt.step, "trainable_only": True},
            fix="build the base from its weights folder, then load the checkpoint into it: "
            "model, opt = tl.build(sch, weights='base-folder'); tl.load(model, opt, "
            f"{path!r}) (torchloom train --model base-folder --resume does both)")
    return ckpt


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
    checkpoint_dir: Any = None  # a verified Checkpoint of a torchloom save directory
    missing: list[str] = []
    if weights is not None:
        path = os.fspath(weights)
        by_id = {id(t.tensor): t for t in wts.model_keys(model)}
        covered: list[int] = []
        if wts.is_torchloom_checkpoint(path):
            checkpoint_dir = _whole_checkpoint(path, getattr(sch, "group", None))
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
                    if located is None and _is_adapter(e.orig):
                        continue  # made by the lora primitive: a weights folder has none
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
