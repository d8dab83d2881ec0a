"""Built-in schedules for common transformers models, looked up by model class.

Each schedule is a short function of primitives with the same knobs:

* ``tp``: Megatron-style tensor parallelism over the schedule's process group (with a
  world of one the primitives are recorded and change nothing); every rank keeps whole
  attention heads, and Llama's KV heads, when fewer than the ranks, are replicated on
  the ranks whose query heads use them (:mod:`torchloom.models.llama`). Config sizes the
  degree must divide are refused, naming the config field, before anything is applied;
* ``sequence_parallel``: split the activations between the parallel regions along the
  sequence axis (needs ``tp``);
* ``ckpt_ratio``: checkpoint the first ``int(ckpt_ratio * layers)`` transformer layers;
* ``compile``: compile every transformer layer in place (the ``compile`` primitive; True
  for inductor, or a backend name), inside the checkpoints and around the TP hooks;
* GPT-2 and BERT also choose kernels: ``attention="sdpa"`` (torchloom.ops' SDPA modules,
  ``"model"`` keeps the model's) and ``fused=True`` (bias+GeLU and
  bias+dropout(+residual+LayerNorm) fused; not with ``tp``, see the error).

>>> import torchloom as tl
>>> from torchloom import models, zoo
>>> sch = tl.create_schedule(zoo.make_model("gpt2"))
>>> models.apply_schedule(sch, tp=True, ckpt_ratio=0.5)
>>> sch.recipe[-1].call_text()
"sch['transformer.h'].checkpoint(ratio=0.5)"
>>> models.supported()
['BertForMaskedLM', 'BertModel', 'GPT2LMHeadModel', 'GPT2Model', 'LlamaForCausalLM', 'LlamaModel', 'OPTForCausalLM', 'OPTModel', 'T5ForConditionalGeneration', 'T5Model', 'ViTForImageClassification', 'ViTModel']
"""

from __future__ import annotations

from typing import Any, Callable

from ..errors import ScheduleError
from ..schedule import Schedule
from ._common import check_compile, check_knobs
from .bert import schedule_bert
from .gpt2 import schedule_gpt2
from .llama import schedule_llama
from .opt import schedule_opt
from .t5 import schedule_t5
from .vit import schedule_vit

__all__ = ["apply_schedule", "schedule_for", "supported", "register_schedule"]

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
    """Add (or override) the built-in schedule of a model class."""
    _REGISTRY[model_class_name] = fn


def supported() -> list[str]:
    """The model class names that have a built-in schedule."""
    return sorted(_REGISTRY)


def schedule_for(model: Any) -> ScheduleFn:
    """The schedule function of ``model``'s class (or of one of its base classes)."""
    for cls in type(model).__mro__:
        if cls.__name__ in _REGISTRY:
            return _REGISTRY[cls.__name__]
    raise ScheduleError(
        f"there is no built-in schedule for {type(model).__name__}",
        primitive="models.schedule_for",
        values={"model": type(model).__name__, "supported": supported()},
        fix="write the schedule with primitives (see torchloom/models/gpt2.py for a short "
        "example), or register one: torchloom.models.register_schedule(name, fn)",
    )


def apply_schedule(sch: Schedule, **knobs: Any) -> None:
    """Apply the built-in schedule of ``sch.mod``'s class to ``sch`` with ``knobs``.

    Everything that can be checked is checked before any primitive is applied, so a
    refused call leaves the model unchanged: the knobs (a knob the schedule does not take
    is an error listing the valid ones), and with ``tp=True`` the config sizes the
    tensor-parallel degree must divide (attention heads, KV heads, MLP features).
    """
    fn = schedule_for(sch.mod)
    check_knobs(sch, fn, knobs)
    if knobs.get("sequence_parallel") and not knobs.get("tp"):
        raise ScheduleError(
            "sequence parallelism splits the activations between tensor-parallel regions; "
            "it needs tp=True",
            path=sch.path, primitive="models.apply_schedule", values=knobs,
            fix="apply_schedule(sch, tp=True, sequence_parallel=True)",
        )
    check_compile(knobs.get("compile", False), sch.path)  # before any primitive is applied
    fn(sch, **knobs)
