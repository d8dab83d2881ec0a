"""Built-in schedules for common transformers models, looked up by model class.

Each schedule is a short function of primitives with the same knobs:

* ``tp``: Megatron-style tensor parallelism over the schedule's process group (with a
  world of one the primitives are recorded and change nothing); every rank keeps whole
  attention heads, and Llama's KV heads, when fewer than the ranks, are replicated on
  the ranks whose query heads use them (:mod:`torchloom.schedules.llama`). Config sizes the
  degree must divide are refused, naming the config field, before anything is applied;
* ``sequence_parallel``: split the activations between the parallel regions along the
  sequence axis (needs ``tp``);
* ``ckpt_ratio``: checkpoint the first ``int(ckpt_ratio * layers)`` transformer layers;
* ``compile``: compile every transformer layer in place (the ``compile`` primitive; True
  for inductor, or a backend name), inside the checkpoints and around the TP hooks;
* GPT-2 and BERT also choose kernels: ``attention="sdpa"`` (torchloom.ops' SDPA modules,
  ``"model"`` keeps the model's) and ``fused=True`` (bias+GeLU and
  bias+dropout(+residual+LayerNorm) fused; not with ``tp``, see the error).

Every other model class whose transformers config declares a tensor-parallel plan
(``base_model_tp_plan``: Qwen2, Mistral, Gemma, Phi-3, Mixtral and about 150 more
families) gets the schedule derived from that plan, :func:`torchloom.schedules.hf_plan.
schedule_hf_plan`, with the same knobs (plus ``vocab_parallel``). The hand-written
schedules stay because they beat the derived one where both apply:

* Llama: one all-reduce of the attention block's input gradient instead of one per q, k
  and v projection (and one for the MLP instead of one per gate and up projection), and
  the embedding and head kept whole (the plan splits them along the vocabulary: one more
  all-reduce and one all-gather per forward, one more all-reduce per backward). Measured
  at TP=2 with 2 layers (tests/test_hf_plan_dist.py), collectives per forward / backward:
  hand-written 4 / 4 all-reduces, derived 5 + 1 all-gather / 11 (10 with
  ``vocab_parallel=False``); with sequence parallelism the hand-written schedule
  reduce-scatters 4 times and all-gathers 5 times per forward, and its backward mirrors
  them plus 5 all-reduces of the norms' gradients (tests/test_tp_models_dist.py);
* Llama and the derived schedules take ``loss_parallel`` (the untied head split along
  the vocabulary, its logits not gathered; ``torchloom.parallelize`` turns it on for
  ``Layout.loss`` "parallel", and for the default "chunked" where the head allows);
* GPT-2, BERT, OPT, T5, ViT: transformers declares no plan for them (GPT-2's fused q/k/v
  is a ``Conv1D`` its styles do not cover).

>>> from transformers import Qwen2Config, Qwen2ForCausalLM
>>> qwen = Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64,
...     num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1, vocab_size=64))
>>> schedule_for(qwen).__name__
'schedule_hf_plan'

>>> import torchloom as tl
>>> from torchloom.schedules import apply_schedule, supported, zoo
>>> sch = tl.create_schedule(zoo.make_model("gpt2"))
>>> apply_schedule(sch, tp=True, ckpt_ratio=0.5)
>>> sch.recipe[-1].call_text()
"sch['transformer.h'].checkpoint(ratio=0.5)"
>>> supported()
['BertForMaskedLM', 'BertModel', 'GPT2LMHeadModel', 'GPT2Model', 'LlamaForCausalLM', 'LlamaModel', 'OPTForCausalLM', 'OPTModel', 'T5ForConditionalGeneration', 'T5Model', 'ViTForImageClassification', 'ViTModel']
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from ..core.errors import NoScheduleError
from ..core.schedule import Schedule
from ._common import check_knobs
from .bert import schedule_bert
from .config import ScheduleConfig, ScheduleConfigError
from .gpt2 import schedule_gpt2
from .hf_plan import from_hf_plan, has_tp_plan, schedule_hf_plan
from .layers import layer_stack_paths, schedule_layers
from .llama import schedule_llama
from .opt import schedule_opt
from .t5 import schedule_t5
from .vit import schedule_vit

__all__ = ["ScheduleConfig", "apply_schedule", "schedule_for", "supported", "register_schedule",
           "from_hf_plan", "schedule_hf_plan", "schedule_layers"]

ScheduleFn = Callable[..., None]

_REGISTRY: dict[str, ScheduleFn] = {
    "GPT2LMHeadModel": schedule_gpt2,
    "GPT2Model": schedule_gpt2,
    "BertForMaskedLM": schedule_bert,
    "BertModel": schedule_bert,
    "LlamaForCausalLM": schedule_llama,
    "LlamaModel": schedule_llama,
    "OPTForCausalLM": schedule_opt,
    "OPTModel": schedule_opt,
    "T5ForConditionalGeneration": schedule_t5,
    "T5Model": schedule_t5,
    "ViTForImageClassification": schedule_vit,
    "ViTModel": schedule_vit,
}


def register_schedule(model_class_name: str, fn: ScheduleFn) -> None:
    """Add (or override) the built-in schedule of a model class: ``fn(sch, config)`` with
    a :class:`ScheduleConfig` (declare the knobs it uses with ``_common.takes``)."""
    _REGISTRY[model_class_name] = fn


def supported() -> list[str]:
    """The model class names that have a built-in schedule."""
    return sorted(_REGISTRY)


def schedule_for(model: Any) -> ScheduleFn:
    """The schedule function of ``model``'s class (or of one of its base classes); for a
    class without one whose transformers config declares a tensor-parallel plan, the
    schedule derived from that plan (:func:`~torchloom.schedules.hf_plan.schedule_hf_plan`);
    for any other model with a stack of layers, checkpointing and compile only
    (:func:`~torchloom.schedules.layers.schedule_layers`)."""
    for cls in type(model).__mro__:
        if cls.__name__ in _REGISTRY:
            return _REGISTRY[cls.__name__]
    if has_tp_plan(model):
        return schedule_hf_plan
    if isinstance(model, nn.Module) and layer_stack_paths(model):
        return schedule_layers
    raise NoScheduleError(
        f"there is no built-in schedule for {type(model).__name__}, and transformers "
        "declares no tensor-parallel plan for it",
        primitive="schedules.schedule_for",
        values={"model": type(model).__name__, "supported": supported()},
        fix="write the schedule with primitives (see torchloom/schedules/gpt2.py for a short "
        "example), pass a plan: torchloom.schedules.hf_plan.from_hf_plan(sch, plan={...}), "
        "or register one: torchloom.schedules.register_schedule(name, fn)",
    )


def apply_schedule(sch: Schedule, config: ScheduleConfig | None = None, **knobs: Any) -> None:
    """Apply the built-in schedule of ``sch.mod``'s class to ``sch``, as ``config`` says or
    with the knobs of a :class:`ScheduleConfig` given by keyword (``tp=True``: over the
    schedule's group).

    Everything that can be checked is checked before any primitive is applied, so a
    refused call leaves the model unchanged: the knobs (a knob the schedule does not take
    is an error listing the valid ones), and with tensor parallelism the config sizes the
    degree must divide (attention heads, KV heads, MLP features).
    """
    fn = schedule_for(sch.mod)
    if config is not None and knobs:
        raise ScheduleConfigError(
            "give the knobs either as a ScheduleConfig or as keywords, not both",
            path=sch.path, primitive="schedules.apply_schedule", values={"knobs": knobs},
            fix=f"apply_schedule(sch, dataclasses.replace(config, **{knobs!r}))")
    check_knobs(sch, fn, knobs if config is None else config.changed())
    fn(sch, config if config is not None else ScheduleConfig.of(sch, **knobs))
