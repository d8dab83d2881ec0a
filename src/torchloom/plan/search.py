"""Search the layouts of N devices for the fastest one that fits.

:func:`enumerate_layouts` lists every layout of ``gpus`` devices that the model can take
for a global batch: tensor-parallel degrees up to a node that divide the attention
heads, KV heads (or are multiples of them) and MLP features; pipeline degrees whose
``pp x stages_per_rank`` stages split the layers evenly, with at least as many
micro-batches as pipeline ranks, run by the ``pipeline_schedule`` asked for (any of
:data:`~torchloom.parallel.layout.PIPELINE_SCHEDULES`); data-parallel degrees that
divide the batch; DDP or FSDP2 (under a pipeline too), and HSDP when asked for
(``dp_mode="hsdp"``: every ``dp_replicate`` that splits the data-parallel ranks, or the
one given); sequence parallelism with tensor parallelism (on by default: the same bytes
as plain tensor parallelism, less activation memory; where the model's schedule refuses it,
the layout is predicted without it); the checkpoint ratios (or
``ac="full"`` / ``"op"``) and micro-batch sizes asked for; context parallelism at the
degree asked for (``cp``, 1 by default; ``cp=None`` tries every degree that divides the
ranks left by tensor parallelism, without a pipeline, where the sequence splits into
``2 cp`` chunks (``2 cp tp`` with sequence parallelism): the data-parallel degree is then
``gpus / (tp x pp x cp)``, and FSDP2 shards over ``dp_shard x cp``; with one data-parallel
rank, DDP over the ``cp`` ranks and FSDP2 over them, ``shard_cp``); expert parallelism at
the degree asked for (``ep``, 1 by default; ``ep=None`` tries every degree that divides the
model's experts and the data-parallel ranks it folds into). What a degree fixed by the
caller leaves is searched. Every layout is a :class:`torchloom.Layout` as
``torchloom train`` makes it (``grad_accum`` micro-steps without a pipeline,
``n_microbatches`` with one).

:func:`search` drops the layouts whose parameters, gradients and optimizer state alone
cannot fit (counted from the model's shapes, before anything is measured), predicts the
rest (:func:`torchloom.plan.predict`; a measurement per tensor-parallel degree and
data-parallel mode serves every depth, stage split and micro-batch size) and ranks them:
those that fit and leave ``min_headroom`` of the usable memory free
(:attr:`~torchloom.plan.predict.Prediction.headroom`) by predicted throughput (tokens per
second), then those that fit with less headroom by throughput, then the others by peak
memory. ``torchloom plan`` asks for 10% headroom
(:data:`~torchloom.plan.predict.HEADROOM`); the default here is 0 (every layout that fits).

>>> result = search("gpt2", 2, "h100-80gb", batch_size=4, seq_len=32, ckpt_ratios=(0.0,),
...                 micro_batches=(2,), tp=1, pp=1)
>>> sorted(p.layout.describe() for p in result.ranked)
['tp1 dp2(ddp) mb2 ckpt0 fp32/bf16', 'tp1 dp2(fsdp) mb2 ckpt0 fp32/bf16']
>>> result.best.tokens_per_s == max(p.tokens_per_s for p in result.ranked)
True
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..core.errors import PlanError, ScheduleError
from .layout import OPTIMIZERS, Layout, check_model
from .predict import Prediction, check_imbalance, predict
from .profiles import Profile, get_profile
from .spec import DTYPES, ModelSpec, model_spec
from .units import ScheduleFn

__all__ = ["SearchResult", "enumerate_layouts", "search", "state_lower_bound"]

Progress = Callable[[int, int, str], None]


@dataclass
class SearchResult:
    """A search: the predictions ranked, and what was left out and why."""

    ranked: list[Prediction]
    rejected: list[tuple[Layout, str]] = field(default_factory=list)
    seconds: float = 0.0
    min_headroom: float = 0.0

    def eligible(self, p: Prediction) -> bool:
        """Whether ``p`` fits and leaves at least :attr:`min_headroom` free."""
        return p.fits and p.headroom >= self.min_headroom

    @property
    def best(self) -> Prediction | None:
        """The fastest layout that fits with :attr:`min_headroom` (None when none does)."""
        return self.ranked[0] if self.ranked and self.eligible(self.ranked[0]) else None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _modes(d: int, dp_mode: str | None, dp_replicate: int | None,
           cp: int = 1) -> list[tuple[int, int, bool]]:
    """``(dp_replicate, dp_shard, shard_cp)`` of ``d`` data-parallel ranks beside ``cp``
    context-parallel ones (one data-parallel rank: DDP over the ``cp`` ranks, and FSDP2
    over them unless ``dp_mode`` is ``"ddp"``)."""
    if d == 1:
        if cp > 1 and dp_mode in (None, "fsdp"):
            return [(1, 1, False), (1, 1, True)]
        return [(1, 1, False)]
    if dp_replicate is not None or dp_mode == "hsdp":
        reps = [dp_replicate] if dp_replicate else [r for r in _divisors(d) if 1 < r < d]
        return [(r, d // r, False) for r in reps if d % r == 0 and 1 < r < d]
    modes = [dp_mode] if dp_mode else ["ddp", "fsdp"]
    return [(d, 1, False) if m == "ddp" else (1, d, False) for m in modes]


def enumerate_layouts(spec: ModelSpec, gpus: int, *, batch_size: int, seq_len: int,
                      gpus_per_node: int = 8, tp: int | None = None, pp: int | None = None,
                      dp: int | None = None, dp_mode: str | None = None,
                      dp_replicate: int | None = None, sp: bool | None = None,
                      ckpt_ratios: Iterable[float] = (0.0, 0.5, 1.0), ac: str | None = None,
                      micro_batches: Iterable[int] = (1, 2, 4, 8),
                      pipeline_schedule: str = "1F1B", stages_per_rank: int | None = None,
                      param_dtype: str = "fp32", mixed_precision: str | None = None,
                      optimizer: str = "adamw", loss: str = "chunked",
                      compile: bool = False, float8: bool = False, async_tp: bool = False,
                      cp: int | None = 1, ep: int | None = 1,
                      ) -> tuple[list[Layout], list[tuple[Layout, str]]]:
    """Every valid layout (see the module docstring), and the ones refused with why.
    ``dp_mode``: ``"ddp"``, ``"fsdp"`` or ``"hsdp"`` (None: DDP and FSDP2);
    ``dp_replicate``: HSDP's replicas; ``ac``: ``"full"`` or ``"op"`` instead of the
    ratios; ``pipeline_schedule`` and ``stages_per_rank``: the pipelines'; ``loss``,
    ``compile``, ``float8``, ``async_tp``: the :class:`~torchloom.parallel.layout.Layout`
    fields of every layout (``loss="parallel"`` is ``"full"`` and ``async_tp`` off where a
    layout has no tensor parallelism or no sequence parallelism: they need it); ``cp``: the
    context-parallel degree (None: every valid one, see the module docstring); ``ep``: the
    expert-parallel degree (None: every one that divides the data-parallel ranks, FSDP2's
    shards under FSDP2, and the model's experts)."""
    out: list[Layout] = []
    rejected: list[tuple[Layout, str]] = []
    ratios = [0.0] if ac else list(ckpt_ratios)
    tps = [tp] if tp else [d for d in _divisors(gpus) if d <= gpus_per_node]
    for t in tps:
        if gpus % t:
            continue
        pps = [pp] if pp else _divisors(gpus // t)
        for p, c in [(q, c) for q in pps for c in _cps(cp, gpus, t, q)]:
            if (gpus // t) % (p * c):
                continue
            d = gpus // (t * p * c)
            if dp is not None and d != dp:
                continue
            if batch_size % d:
                continue
            local = batch_size // d
            pipe: dict[str, Any] = {"pipeline_schedule": pipeline_schedule,
                                    "stages_per_rank": stages_per_rank} if p > 1 else {}
            sps = [sp] if sp is not None else [t > 1]
            for rep, shard, over_cp in _modes(d, dp_mode, dp_replicate, c):
                for s in sps:
                    if s and t == 1:
                        continue
                    for mb in micro_batches:
                        if local % mb:
                            continue
                        n = local // mb
                        if p > 1 and n < p:
                            continue
                        steps: dict[str, Any] = ({"n_microbatches": n} if p > 1
                                                 else {"grad_accum": n})
                        for r, e in [(r, e) for r in ratios
                                     for e in _eps(ep, spec, rep, shard)]:
                            try:
                                lay = Layout(tp=t, sp=s, pp=p, cp=c, ep=e, dp_replicate=rep,
                                             dp_shard=shard, shard_cp=over_cp, **pipe, **steps,
                                             micro_batch=mb, seq_len=seq_len, ckpt_ratio=r,
                                             ac=ac, param_dtype=param_dtype,
                                             mixed_precision=mixed_precision,
                                             optimizer=optimizer, compile=compile,
                                             float8=float8,
                                             loss="full" if loss == "parallel" and t == 1
                                             else loss,
                                             async_tp=async_tp and t > 1 and s)
                            except PlanError:
                                continue
                            try:
                                check_model(lay, spec)
                            except PlanError as err:
                                rejected.append((lay, err.problem))
                                continue
                            out.append(lay)
    return out, rejected


def _cps(cp: int | None, gpus: int, tp: int, pp: int) -> list[int]:
    """The context-parallel degrees to try beside ``tp`` and ``pp`` (``Layout`` refuses
    the ones the sequence does not split into)."""
    if cp is not None:
        return [cp]
    if gpus % (tp * pp):
        return [1]
    return _divisors(gpus // (tp * pp))


def _eps(ep: int | None, spec: ModelSpec, replicate: int, shard: int) -> list[int]:
    """The expert-parallel degrees to try: the one given, or (None) every degree that
    divides the model's experts and the ranks it folds into (FSDP2's shards, else DDP's
    replicas)."""
    if ep is not None:
        return [ep]
    experts = spec.attr("num_local_experts", "num_experts", "n_routed_experts")
    if not isinstance(experts, int) or experts < 2:
        return [1]
    ranks = shard if shard > 1 else replicate
    return [d for d in _divisors(ranks) if experts % d == 0]


def _layer_params(spec: ModelSpec) -> tuple[int, int, int]:
    """(parameters of one layer, the others, the experts' of one layer) of the model,
    from its meta build."""
    from ..primitives.expert_parallel import experts_modules

    model = spec.build(depth=1)
    stack = model.get_submodule(spec.layers)
    layer = sum(p.numel() for p in stack.parameters())
    experts = sum(p.numel() for _, m in experts_modules(stack) for p in m.parameters())
    return layer, sum(p.numel() for p in model.parameters()) - layer, experts


def state_lower_bound(layout: Layout, layer_params: int, num_layers: int,
                      expert_params: int = 0) -> int:
    """Bytes that parameters, gradients and optimizer state need at least on the busiest
    rank: its stages' layers split between the tensor-parallel ranks (and the FSDP2
    shards), in the parameter dtype; of them ``expert_params`` per layer (the experts)
    split between the ``ep`` ranks only."""
    per_rank = max(layout.stage_layers(num_layers)) * layout.per_rank
    # FSDP2 shards over dp_shard x cp; DDP keeps whole parameters on every cp rank
    share = layout.tp * layout.shards
    size = DTYPES[layout.param_dtype].itemsize
    experts = expert_params // layout.ep if layout.ep > 1 else expert_params // share
    per_layer = (layer_params - expert_params) // share + experts
    return per_rank * per_layer * size * (2 + OPTIMIZERS[layout.optimizer])


def search(model: Any, gpus: int, profile: str | Profile = "h100-80gb", *, batch_size: int,
           seq_len: int, schedule: ScheduleFn | None = None, size: str = "tiny",
           progress: Progress | None = None, min_headroom: float = 0.0,
           imbalance: float = 1.0, lora: Any = None, **space: Any) -> SearchResult:
    """Rank the layouts of ``gpus`` devices for ``model`` (see the module docstring).
    ``space``: the keyword arguments of :func:`enumerate_layouts` (degrees, modes, ratios,
    micro-batch sizes, dtypes, optimizer); ``progress(done, total, what)`` is called
    before each prediction; ``min_headroom``: the share of the usable memory a layout
    must leave free to rank among the first; ``imbalance``: the routing imbalance of
    expert-parallel layouts (:func:`~torchloom.plan.predict.predict`); ``lora``: LoRA
    fine-tuning (a :class:`~torchloom.parallel.lora.LoraSpec`), for every layout."""
    started = time.perf_counter()
    check_imbalance(imbalance)
    spec = model_spec(model, size=size, seq_len=seq_len)
    prof = get_profile(profile)
    space.setdefault("gpus_per_node", prof.gpus_per_node)
    space.setdefault("mixed_precision", "bf16" if "bf16" in prof.flops else None)
    layouts, rejected = enumerate_layouts(spec, gpus, batch_size=batch_size,
                                          seq_len=seq_len, **space)
    if not layouts and not rejected:
        raise PlanError(
            f"no layout of {gpus} devices takes a batch of {batch_size} sequences",
            primitive="plan", values={"gpus": gpus, "batch_size": batch_size, **{
                k: v for k, v in space.items() if k in ("tp", "pp", "dp")}},
            fix=f"a --batch-size divisible by the data-parallel degree, e.g. {gpus}")
    layer, _, expert_layer = _layer_params(spec)
    todo = []
    for lay in layouts:
        need = state_lower_bound(lay, layer, spec.num_layers, expert_layer)
        if need > prof.budget:
            rejected.append((lay, f"parameters, gradients and optimizer state alone need "
                                  f"{need / 2**30:.1f} GiB > {prof.budget / 2**30:.1f} GiB"))
        else:
            todo.append(lay)
    # measurements are shared by layouts with the same tensor-parallel degree and mode:
    # predict those groups together so that a progress bar moves evenly
    todo.sort(key=lambda l: (l.tp, l.sp, l.dp_mode, l.dp_replicate, l.ep, l.pp > 1, l.pp,
                             l.micro_batch, l.ckpt_ratio))
    preds: list[Prediction] = []
    for i, lay in enumerate(todo):
        if progress is not None:
            progress(i, len(todo), lay.describe())
        try:
            preds.append(predict(spec, lay, prof, schedule=schedule, imbalance=imbalance,
                                 lora=lora))
        except ScheduleError as err:  # a layout refused, or a schedule the model refuses
            rejected.append((lay, err.problem))
            if lay.sp and space.get("sp") is None:
                # the model's schedule refuses sequence parallelism (a router that mixes
                # positions): the same layout without it, which the search did not list
                try:
                    plain = lay.replace(sp=False, async_tp=False)
                    preds.append(predict(spec, plain, prof, schedule=schedule,
                                         imbalance=imbalance, lora=lora))
                except ScheduleError as again:
                    rejected.append((lay, f"without sequence parallelism: {again.problem}"))
    if progress is not None:
        progress(len(todo), len(todo), "done")
    preds.sort(key=lambda p: (not p.fits, p.headroom < min_headroom,
                              -p.tokens_per_s if p.fits else p.peak))
    return SearchResult(preds, rejected, time.perf_counter() - started, min_headroom)
