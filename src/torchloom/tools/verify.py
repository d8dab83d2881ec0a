"""``Verify``: prove that a schedule still computes what the original model computed.

Wrap the primitives in ``with torchloom.Verify(sch, example_inputs):``. When the block is
entered, the model as it is then becomes the reference (a deep copy; in a process group
its weights are first broadcast from the group's rank 0 so every rank starts from the
same model). When the block exits without an exception:

1. the static check :func:`torchloom.tools.check.check` runs first; a schedule whose shards and
   syncs do not compose is refused before anything executes;
2. the reference and the scheduled model run forward (and, with ``check_backward``,
   backward) on the same inputs (broadcast from rank 0) with the same seed, so dropout
   draws the same masks outside tensor-parallel regions;
3. the output of every module, in execution order, is compared with the reference
   module at the same path (a sharded activation with the matching slice of the
   reference, a partial sum after summing it across ranks); then the gradient each
   module passes to its input, in backward order; then every parameter's gradient (a
   sharded parameter against the matching slice of the reference gradient);
4. the first tensor whose largest difference exceeds ``atol + rtol * max|reference|``
   raises :class:`VerificationError` naming the module path, what differed and by how
   much. The bound scales with the tensor's largest magnitude, not element by element:
   a reordered sum (tensor parallelism) leaves round-off relative to the terms summed,
   which an element near zero does not show.

A model built under ``init_empty_weights`` (``meta`` weights) can be verified too: on
entry the reference is a copy of the meta model (nothing allocated); on exit both are
materialised as ``build`` materialises (:func:`torchloom.build`: the model's own init code
from the same seed, ``Verify(seed=...)``, each sharded tensor the matching slice of the
full one), or loaded from ``Verify(..., weights=PATH)`` (a folder ``build(weights=)``
reads); every scheduled tensor that has a reference counterpart then takes the
reference's value (sliced), so an init order that a replacement changed cannot make the two
differ. After the comparison the scheduled model's tensors are put back on ``meta``: the
schedule is still built with ``tl.build`` as it would have been.

Every global state Verify touches (random generators, the RNG tracker, grad mode, the
training flags, the parameters' ``.grad``, its hooks) is restored, also on failure.
``Verify(..., enable=False)`` does nothing. In a process group every rank must enter the
block (the comparison is collective) and all ranks agree on the verdict.

Context and expert parallelism: the context-parallel ranks run the same sequences (each
compared at its own positions). The expert-parallel ranks (``expert_parallel``) run the
same tokens and start from their group's rank 0's weights (each rank's experts sliced
from them); an experts module is compared by its output (the modules inside it run on
the tokens routed to this rank's experts, not on this rank's), and each expert's
gradient, the sum over the ranks' identical tokens, is divided by the degree.

Modules that a ``replace`` introduced have no reference at their path and are compared
through their outputs; their new parameters are compared only if ``param_map`` maps them
to reference parameter names (``{"mlp.fused.weight": "mlp.c_fc.weight"}``).

Tolerances: ``rtol=1e-4, atol=1e-7`` by default (relative to each tensor's largest
magnitude), suitable for fp32 where a schedule only reorders sums (tensor parallelism,
fused kernels): their round-off is about 1e-6 of the largest term, while a wrong schedule
errs by a sizeable fraction of it. Use ``0, 0`` to demand bitwise equality
(checkpointing, annotate).

>>> import torch, torchloom as tl
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU(), torch.nn.Linear(4, 2))
>>> sch = tl.create_schedule(model)
>>> with tl.Verify(sch, (torch.randn(3, 4),)):
...     sch["0"].checkpoint()
>>> with tl.Verify(sch, (torch.randn(3, 4),)):  # doctest: +ELLIPSIS
...     sch["1"].replace(torch.nn.ReLU())
Traceback (most recent call last):
...
torchloom.core.errors.VerificationError: sch['1'].Verify(...): the forward output differs from the original model's
    values: phase='forward output', call=0, max_abs_error=..., rtol=0.0001, atol=1e-07
    fix: look at what the schedule did at or below this path: sch['1'].replace(...)
"""

from __future__ import annotations

import contextlib
import copy
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Callable, Iterator, Literal

import torch
import torch.distributed as dist
from torch import nn

from ..core.errors import ScheduleError, VerificationError
from ..core.marks import CONTEXT_PARALLEL, EXPERT_PARALLEL, SYNCS, get_mark
from ..core.meta import ShardSpec, shard_spec
from ..core.outputs import tensors_in
from ..core.placement import output_placement
from ..runtime import collectives as C
from ..runtime.adapters import is_lora_layer
from ..runtime.agree import check_ranks_agree
from ..runtime.rng import get_rng_tracker
from .check import check, effective_output_placement
from .verify_record import Record, Recorder
from .verify_sync import align_experts
from .verify_sync import broadcast_in as _broadcast_in

if TYPE_CHECKING:
    from ..core.schedule import Schedule

__all__ = ["Verify", "VerificationError", "materialise"]


def _default_loss(output: Any) -> torch.Tensor:
    """``output.loss`` if the model computed one, else a fixed random projection of the
    first output tensor (its gradient is O(1) everywhere, unlike a mean)."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    first = tensors_in(output)[0]
    weights = torch.randn(first.shape, generator=torch.Generator().manual_seed(0))
    return (first.float() * weights.to(first.device)).sum()


def materialise(model: nn.Module, device: torch.device, seed: int,
                weights: str | os.PathLike | None = None, group: Any = None) -> None:
    """Make every ``meta`` tensor of ``model`` real, as ``build`` does: the model's own init
    code run from ``seed`` (each sharded tensor the matching slice of the full one), or
    loaded from ``weights`` (the folders ``build(weights=...)`` reads). The global random
    state is left as it was. The hook ``Verify`` materialises through."""
    from ..runtime.materialise import _materialise

    shim = SimpleNamespace(mod=model, group=group)  # what _materialise reads of a schedule
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        _materialise(shim, init_weights=False, dev=torch.device(device), param_init_fn=None,
                     init="full", weights=weights, strict=False)


@dataclass
class _Saved:
    cpu_rng: torch.Tensor
    cuda_rng: list[torch.Tensor] | None
    tracker: Any
    grad_enabled: bool
    training: list[tuple[nn.Module, bool]]
    grads: list[tuple[nn.Parameter, torch.Tensor | None]]


class Verify:
    """Differential test of the primitives applied inside the ``with`` block.

    Args:
        sch: the schedule (its root is used).
        example_inputs: positional inputs (a tuple) or keyword inputs (a dict).
        device: where both models run; inputs are moved there.
        check_backward: also compare input and parameter gradients.
        rtol, atol: the tolerances of every comparison.
        enable: False makes the block a no-op.
        seed: the seed both runs start from (dropout masks).
        loss_fn: output -> scalar to differentiate; default: ``output.loss`` if the model
            returns one, else the mean square of the first output tensor.
        param_map: scheduled parameter name -> reference name, for parameters a
            replacement renamed.
        static_check: run :func:`torchloom.tools.check.check` first.
        pipeline_example: the micro-batch the pipeline will be built with
            (``build(..., example_inputs=...)``); with ``cut_pipeline_stage`` marks, each
            stage is also run on the verification inputs to catch values a stage fixed to
            their example value (default: the verification inputs themselves).
        weights: for a model with ``meta`` weights, the folder both models are loaded
            from (what ``build(sch, weights=...)`` accepts); None: the seeded init.
    """

    def __init__(
        self,
        sch: Schedule,
        example_inputs: tuple | dict,
        device: str | torch.device = "cpu",
        check_backward: bool = True,
        rtol: float = 1e-4,
        atol: float = 1e-7,
        enable: bool = True,
        seed: int = 2024,
        loss_fn: Callable[[Any], torch.Tensor] | None = None,
        param_map: dict[str, str] | None = None,
        static_check: bool = True,
        pipeline_example: tuple | dict | None = None,
        weights: str | os.PathLike | None = None,
    ) -> None:
        self.sch = sch.root
        self.example_inputs = example_inputs
        self.device = torch.device(device)
        self.check_backward = check_backward
        self.rtol, self.atol = rtol, atol
        self.enable = enable
        self.seed = seed
        self.loss_fn = loss_fn or _default_loss
        self.param_map = dict(param_map or {})
        self.static_check = static_check
        self.pipeline_example = pipeline_example
        self.weights = weights
        self._meta = False  # the model had meta tensors on entry: materialised on exit
        self.reference: nn.Module | None = None
        self._recipe_start = 0
        #: the model's context-parallel state while comparing (None: no context parallelism)
        self._cp: Any = None
        self._ep: Any = None
        self._inside_experts: tuple[str, ...] = ()
        self._seq = 0
        #: what the last verification compared: tensors per phase (incomparable ones,
        #: such as modules a replacement introduced, are not counted)
        self.stats: dict[str, int] = {}

    # ------------------------------------------------------------------ context

    def __enter__(self) -> Verify:
        if not self.enable:
            return self
        check_ranks_agree(self.sch, primitive="Verify")  # before weights are broadcast
        model = self.sch.mod
        from ..runtime.model_check import check_model_sizes

        check_model_sizes(model, primitive="Verify")
        from ..runtime.materialise import has_meta_tensors

        self._meta = has_meta_tensors(model)
        if self.weights is not None and not self._meta:
            raise VerificationError(
                "weights= loads a model built under init_empty_weights; this model already "
                "has its weights",
                path=self.sch.path, primitive="Verify",
                values={"weights": os.fspath(self.weights)},
                fix="drop weights=, or build the model under tl.init_empty_weights()",
            )
        if self._distributed() and not self._meta:  # meta: materialised alike on each rank
            with torch.no_grad():
                _broadcast_in(self.sch.group, [t.data for t in (*model.parameters(),
                                                                *model.buffers())],
                              self.sch.path)
        self.reference = copy.deepcopy(model)
        self._recipe_start = len(self.sch.recipe)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        if not self.enable or exc_type is not None:
            self.reference = None
            return False
        try:
            self._verify()
        finally:
            self.reference = None
        return False

    # ------------------------------------------------------------------ helpers

    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and C.group_size(self.sch.group) > 1

    def _inputs(self) -> tuple[tuple, dict]:
        value = self.example_inputs
        args, kwargs = ((), dict(value)) if isinstance(value, dict) else (tuple(value), {})

        def prepare(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            x = x.detach().to(self.device).clone()
            if self._distributed():
                _broadcast_in(self.sch.group, [x], self.sch.path)
            if self._cp is not None:  # the context-parallel ranks split the same sequences
                _broadcast_in(self._cp.group, [x], self.sch.path)
            if self._ep is not None:  # the expert-parallel ranks route the same tokens
                _broadcast_in(self._ep.group, [x], self.sch.path)
            return x

        return tuple(prepare(a) for a in args), {k: prepare(v) for k, v in kwargs.items()}

    def _save(self, models: list[nn.Module]) -> _Saved:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        return _Saved(
            cpu_rng=torch.get_rng_state(),
            cuda_rng=cuda,
            tracker=get_rng_tracker().get_states(),
            grad_enabled=torch.is_grad_enabled(),
            training=[(m, m.training) for model in models for m in model.modules()],
            grads=[(p, p.grad) for p in self.sch.mod.parameters()],
        )

    @staticmethod
    def _restore(saved: _Saved) -> None:
        torch.set_rng_state(saved.cpu_rng)
        if saved.cuda_rng is not None:
            torch.cuda.set_rng_state_all(saved.cuda_rng)
        get_rng_tracker().set_states(saved.tracker)
        torch.set_grad_enabled(saved.grad_enabled)
        for module, mode in saved.training:
            module.training = mode
        for param, grad in saved.grads:
            param.grad = grad

    def _recipe_lines(self, path: str) -> str:
        lines = [e.call_text_safe() for e in list(self.sch.recipe)[self._recipe_start:]
                 if e.path == path or e.path.startswith(path + ".") or path == ""]
        if not lines:
            lines = [e.call_text_safe() for e in list(self.sch.recipe)[self._recipe_start:]
                     if path.startswith(e.path + ".") or e.path == ""]
        return "; ".join(lines[:4]) if lines else "(no primitive in the block touches it)"

    def _fail(self, path: str, problem: str, values: dict[str, Any]) -> VerificationError:
        return VerificationError(
            problem, path=path, primitive="Verify",
            values={**values, "rtol": self.rtol, "atol": self.atol},
            fix=f"look at what the schedule did at or below this path: {self._recipe_lines(path)}",
        )

    # ------------------------------------------------------------------ the run

    def _run(self, model: nn.Module, recorder: Recorder, args: tuple, kwargs: dict) -> None:
        torch.manual_seed(self.seed)
        if torch.cuda.is_available():
            torch.cuda.manual_seed_all(self.seed)
        tracker = get_rng_tracker()
        if tracker.is_seeded():
            tracker.set_states(self._tracker_start)
        model.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(self.check_backward):
            output = model(*args, **kwargs)
            if self.check_backward:
                self.loss_fn(output).backward()

    def _verify(self) -> None:
        assert self.reference is not None
        check_ranks_agree(self.sch, primitive="Verify")  # the block scheduled alike
        if self.static_check:
            report = check(self.sch)
            if not report.ok:
                first = report.findings[0]
                raise VerificationError(
                    f"the static check refuses the schedule: {first.rule}: {first.problem}"
                    + (f" (and {len(report.findings) - 1} more)" if len(report.findings) > 1 else ""),
                    path=first.path, primitive="Verify",
                    values={"findings": [f"{f.path}: {f.rule}" for f in report.findings]},
                    fix=first.fix,
                )
        self._mirror_lora()
        with self._materialised():
            self._compare()

    def _mirror_lora(self) -> None:
        """LoRA adapters added inside the block (``lora``): the reference gets the same
        ones (the primitive draws them at full shape from its seed, so the reference's
        equal the scheduled ones, sliced), and the two compare with their bases frozen."""
        from ..core.schedule import create_schedule
        from ..runtime.adapters import lora_state

        assert self.reference is not None
        found = lora_state(self.sch.mod)
        if found is None or lora_state(self.reference) is not None:
            return
        path, state = found
        ref = create_schedule(self.reference)
        ref[path].lora(state.r, state.alpha, list(state.targets), dropout=state.dropout,
                       seed=state.seed, init=state.init)

    def _compare(self) -> None:
        assert self.reference is not None
        model = self.sch.mod
        reference = self.reference.to(self.device)
        cp = get_mark(model, CONTEXT_PARALLEL)
        self._cp = cp if cp is not None and cp.size > 1 else None
        if self._cp is not None:  # every context-parallel rank starts from rank 0's weights
            with torch.no_grad():
                _broadcast_in(self._cp.group, [t.data for m in (model, reference)
                                               for t in (*m.parameters(), *m.buffers())],
                              self.sch.path)
        self._ep = next((state for m in model.modules()
                         if (state := get_mark(m, EXPERT_PARALLEL)) is not None
                         and state.size > 1), None)
        # the modules inside an expert-parallel experts module run on the tokens routed
        # to this rank's experts, not on this rank's tokens: compared as the module's output
        self._inside_experts = tuple(f"{name}." for name, m in model.named_modules()
                                     if get_mark(m, EXPERT_PARALLEL) is not None)
        # a LoRA layer's base and adapters are parallel branches whose partial sums are
        # reduced together at the layer: compared by the layer's output
        self._inside_experts += tuple(f"{name}." for name, m in model.named_modules()
                                      if is_lora_layer(m))
        if self._ep is not None:
            align_experts(model, reference, self._ep.group, self.param_map, self.sch.path)
        saved = self._save([model, reference])
        self._tracker_start = get_rng_tracker().get_states()
        ref_rec = Recorder(reference, self.check_backward)
        rec = Recorder(model, self.check_backward)
        try:
            args, kwargs = self._inputs()
            first = kwargs.get("input_ids", kwargs.get("inputs_embeds", args[0] if args else None))
            self._seq = int(first.shape[1]) if isinstance(first, torch.Tensor) and \
                first.dim() > 1 else 0
            self._run(reference, ref_rec, args, kwargs)
            try:
                self._run(model, rec, args, kwargs)
            except ScheduleError:
                raise
            except Exception as exc:  # noqa: BLE001 - reported with the module that raised
                path = rec.stack[-1] if rec.stack else self.sch.path
                raise self._fail(path, f"the scheduled model raised {type(exc).__name__}: {exc}",
                                 {"phase": "forward"}) from exc
            self._compare_records(rec.outputs, ref_rec.outputs, "forward output", forward=True)
            self._check_pipeline_split(args, kwargs)
            if self.check_backward:
                self._compare_records(rec.input_grads, ref_rec.input_grads, "input gradient",
                                      forward=False)
                self._compare_param_grads(model, reference)
        finally:
            rec.remove()
            ref_rec.remove()
            self._restore(saved)

    @contextlib.contextmanager
    def _materialised(self) -> Iterator[None]:
        """For a model that had ``meta`` tensors on entry: materialise the reference and
        the scheduled model (seeded init or ``weights``), give every scheduled tensor the
        reference's value, and put the scheduled model's meta tensors back afterwards."""
        if not self._meta:
            yield
            return
        assert self.reference is not None
        model = self.sch.mod
        # (module, its _parameters or _buffers dict, name, tensor): put back on exit
        slots: list[tuple[nn.Module, dict[str, Any], str, torch.Tensor]] = [
            (m, slot, name, t) for m in model.modules()
            for slot in (m._parameters, m._buffers) for name, t in slot.items()
            if t is not None]
        from ..runtime.model_check import check_fits, meta_bytes

        check_fits(meta_bytes(self.reference) + meta_bytes(model), self.device,
                   primitive="Verify", path=self.sch.path,
                   what="materialising the reference and the scheduled model",
                   values={"model": type(model).__name__},
                   fix="verify a smaller config of the model (fewer layers, a smaller "
                   "hidden size), or on a machine with more memory")
        try:
            materialise(self.reference, self.device, self.seed, self.weights, None)
            materialise(model, self.device, self.seed, self.weights, self.sch.group)
            self._take_reference_values(model, {(id(m), name) for m, _, name, t in slots
                                                if t.is_meta})
            yield
        finally:
            for _, slot, name, t in slots:
                slot[name] = t

    def _take_reference_values(self, model: nn.Module, was_meta: set[tuple[int, str]]) -> None:
        """Copy the reference's tensors into the scheduled tensors that were ``meta`` (by
        name, through ``param_map``; a sharded one takes its slice)."""
        assert self.reference is not None
        ref: dict[str, torch.Tensor] = {
            **dict(self.reference.named_parameters(remove_duplicate=False)),
            **dict(self.reference.named_buffers(remove_duplicate=False))}
        with torch.no_grad():
            for m_path, m in model.named_modules(remove_duplicate=False):
                for slot in (m._parameters, m._buffers):
                    for name, tensor in slot.items():
                        if tensor is None or (id(m), name) not in was_meta:
                            continue
                        full = f"{m_path}.{name}" if m_path else name
                        source = ref.get(self.param_map.get(full, full))
                        if source is None:
                            continue
                        spec = shard_spec(tensor)
                        if spec is not None and tuple(spec.full_shape) == tuple(source.shape):
                            source = spec.slice(source)
                        if tuple(source.shape) == tuple(tensor.shape):
                            tensor.copy_(source.to(tensor.device, tensor.dtype))

    def _check_pipeline_split(self, args: tuple, kwargs: dict) -> None:
        """With ``cut_pipeline_stage`` marks: run each stage on the values the whole model
        computes for the verification inputs, so that a value a stage took as a constant
        from the example micro-batch, and that differs here, is caught at its cut."""
        from ..runtime.pipeline_split import cut_paths, replay_stages, split_stages

        if not cut_paths(self.sch):
            return
        example = self.pipeline_example if self.pipeline_example is not None else (
            kwargs if kwargs else args)
        stages = split_stages(self.sch, example)
        inputs = kwargs if kwargs else args
        pairs = replay_stages(stages, inputs)
        for k, (got, expected) in enumerate(pairs, start=1):
            failed = isinstance(got, Exception)
            excess = [] if failed else self._errors(
                [(g, e) for g, e in zip(tensors_in(got), tensors_in(expected))])
            if failed or any(e == e and e > 0 for e in excess):
                cut = stages.cuts[k - 1]
                raise self._fail(
                    cut,
                    f"pipeline stage {k} (after this cut) computes something else than the "
                    "model: it uses values from earlier stages that are not tensors and "
                    "were fixed to their value on the example micro-batch",
                    {"phase": "pipeline stage", "stage": k, "constants": stages.folded[k],
                     **({"raised": f"{type(got).__name__}: {got}"[:200]} if failed else {})},
                )

    # ------------------------------------------------------------------ comparisons

    def _local_reference(self, value: torch.Tensor, ref: torch.Tensor,
                         module: nn.Module | None, forward: bool) -> torch.Tensor | None:
        """The part of ``ref`` this rank's ``value`` should equal, or None if the two
        cannot be compared."""
        if self._cp is not None:  # this rank's positions of a sequence axis
            ref = self._cp_positions(value, ref)
        if value.shape == ref.shape:
            return ref
        if value.dim() != ref.dim():
            return None
        diffs = [i for i in range(ref.dim()) if ref.shape[i] != value.shape[i]]
        world = C.group_size(self.sch.group)
        if len(diffs) != 1 or ref.shape[diffs[0]] != value.shape[diffs[0]] * world:
            return None
        axis, chunks = diffs[0], 1
        weight = module._parameters.get("weight") if (module is not None and forward) else None
        spec = shard_spec(weight) if weight is not None else None
        if spec is not None and axis == ref.dim() - 1:
            chunks = spec.chunks
        local = ShardSpec(axis=axis, full_shape=tuple(ref.shape), world_size=world,
                          rank=C.group_rank(self.sch.group), chunks=chunks)
        return local.slice(ref)

    def _cp_positions(self, value: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        """``ref`` with only this context-parallel rank's positions along its first axis of
        the whole sequence's length (where ``value`` has ``1 / cp`` of them)."""
        from ..ops.context_parallel import shard_index

        cp = self._cp
        for axis in range(min(ref.dim(), value.dim())):
            if ref.shape[axis] == self._seq and value.shape[axis] * cp.size == self._seq:
                index = shard_index(self._seq, cp.size, cp.rank, ref.device)
                return ref.index_select(axis, index)
        return ref

    def _is_partial(self, path: str, module: nn.Module, forward: bool) -> bool:
        """Whether the recorded value of ``module`` is a legitimate per-rank partial sum:
        the output of a row-parallel module that an enclosing block reduces, or the input
        gradient of a column-parallel module whose reduction sits on an enclosing block.
        (A partial sum nothing reduces is a bug and is compared as it is.)"""
        if forward:
            placement = effective_output_placement(module)
            if placement is None or placement.kind != "partial":
                return False
            parts = path.split(".")
            for depth in range(len(parts) - 1, -1, -1):
                ancestor = self.sch.mod.get_submodule(".".join(parts[:depth]))
                if any(s.mode == "fwd_post" and s.op in ("all_reduce", "reduce_scatter")
                       for s in get_mark(ancestor, SYNCS, [])):
                    return True
            return False
        placement = output_placement(module)
        if placement is None or placement.kind != "shard":
            return False
        own = get_mark(module, SYNCS, [])
        return not any((s.mode == "bwd_post" and s.op == "all_reduce")
                       or (s.mode == "fwd_pre" and s.op == "all_gather") for s in own)

    def _errors(self, pairs: list[tuple[torch.Tensor, torch.Tensor | None]]) -> list[float]:
        """Per pair, how far it is beyond tolerance (<= 0: fine; nan: incomparable),
        agreed across ranks."""
        excess = []
        for value, ref in pairs:
            if ref is None:
                excess.append(float("nan"))
                continue
            diff = (value.double() - ref.double()).abs()
            if not diff.numel():
                excess.append(0.0)
                continue
            bound = self.atol + self.rtol * float(ref.double().abs().max())
            excess.append(float(diff.max()) - bound)
        # every rank the schedule spans agrees: the tensor-parallel group, or with
        # context parallelism every rank
        group = None if self._cp is not None else self.sch.group
        if (self._distributed() or self._cp is not None) and excess:
            tensor = torch.tensor([(-1e300 if e != e else e) for e in excess], dtype=torch.float64)
            with C.guard_collective("all_reduce", "Verify", group, path=self.sch.path):
                dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
            excess = [float("nan") if (e != e) else float(t) for e, t in zip(excess, tensor.tolist())]
        return excess

    def _compare_records(self, records: list[Record], ref_records: list[Record], phase: str,
                         forward: bool) -> None:
        refs = {(r.path, r.call): r for r in ref_records}
        pairs: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        if self._inside_experts:
            records = [r for r in records if not r.path.startswith(self._inside_experts)]
        for record in records:
            ref = refs.get((record.path, record.call))
            if ref is None:
                pairs.append((record.value, None))
                continue
            value = record.value
            if self._cp is not None and not forward:
                # the loss is summed over the context-parallel ranks, and its backward hands
                # every rank cp times its own part (the gradient average over dp x cp
                # undoes it): compare the part itself
                value = value / self._cp.size
            if record.module is not None and self._is_partial(record.path, record.module, forward):
                value = C.all_reduce_raw(value, self.sch.group)  # a sum of per-rank parts
            pairs.append((value, self._local_reference(value, ref.value, record.module, forward)))
        self.stats[phase] = sum(ref is not None for _, ref in pairs)
        for record, (value, expected), excess in zip(records, pairs, self._errors(pairs)):
            if excess == excess and excess > 0:  # not nan, beyond tolerance
                assert expected is not None  # an incomparable pair's excess is nan
                raise self._fail(
                    record.path,
                    f"the {phase} differs from the original model's",
                    {"phase": phase, "call": record.call,
                     "max_abs_error": float((value.double() - expected.double()).abs().max())},
                )

    def _compare_param_grads(self, model: nn.Module, reference: nn.Module) -> None:
        ref_params = dict(reference.named_parameters(remove_duplicate=False))
        names: list[str] = []
        pairs: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        for name, param in model.named_parameters():
            ref = ref_params.get(self.param_map.get(name, name))
            if ref is None or param.grad is None or ref.grad is None:
                continue
            spec = shard_spec(param)
            expected: torch.Tensor = ref.grad
            if spec is not None and tuple(spec.full_shape) == tuple(ref.grad.shape):
                expected = spec.slice(ref.grad)
            elif expected.shape != param.grad.shape:
                continue
            names.append(name)
            mine = param.grad
            if self._cp is not None:  # the average over the context-parallel ranks
                mine = C.all_reduce_raw(mine, self._cp.group) / self._cp.size
            if self._ep is not None and spec is not None and spec.group is not None:
                # an expert's gradient sums every expert-parallel rank's tokens routed to
                # it; the ranks ran the same tokens
                mine = mine / self._ep.size
            pairs.append((mine, expected))
        self.stats["parameter gradient"] = len(pairs)
        for name, (value, grad), excess in zip(names, pairs, self._errors(pairs)):
            if excess == excess and excess > 0 and grad is not None:
                path = name.rpartition(".")[0]
                raise self._fail(
                    path,
                    f"the gradient of parameter {name!r} differs from the original model's",
                    {"phase": "parameter gradient", "parameter": name,
                     "max_abs_error": float((value.double() - grad.double()).abs().max())},
                )

