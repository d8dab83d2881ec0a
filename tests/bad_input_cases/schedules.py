"""Bad-input rows: the built-in schedules (issue 13 item 7, issue 14 item 6).

An unknown knob of ``schedules.apply_schedule``, and tensor parallelism over a group whose
size does not divide a config size the schedule splits: attention heads (every built-in),
Llama's KV heads (neither a multiple nor a divisor of the degree), the MLP's features.
All are refused before any primitive is applied, naming the config field.

The models come from transformers' default configs with only sizes changed, built on
``meta`` (nothing allocated); a tensor-parallel degree is faked on the root schedule,
which is all these checks read.
"""

from __future__ import annotations

from typing import Any, Callable

import transformers

import torchloom as tl
from torchloom import schedules


def _refused(model_class: str, config_class: str, world: int = 1, knobs: dict | None = None,
             **sizes: Any) -> None:
    with tl.init_empty_weights():
        config = getattr(transformers, config_class)(**sizes)
        model = getattr(transformers, model_class)(config)
    sch = tl.create_schedule(model)
    sch.world_size = world
    schedules.apply_schedule(sch, **(knobs if knobs is not None else {"tp": True}))


_GPT2 = dict(n_layer=1, n_embd=32, n_head=4, vocab_size=64, bos_token_id=0, eos_token_id=0)
_LLAMA = dict(num_hidden_layers=1, hidden_size=48, intermediate_size=96, vocab_size=64)


def schedule_unknown_knob():
    _refused("GPT2LMHeadModel", "GPT2Config", knobs={"ckpt": 0.5}, **_GPT2)


def schedule_unknown_knob_without_a_near_name():
    _refused("LlamaForCausalLM", "LlamaConfig", knobs={"tp": True, "attention": "sdpa"},
             num_attention_heads=4, **_LLAMA)


def schedule_gpt2_heads_do_not_divide():
    _refused("GPT2LMHeadModel", "GPT2Config", world=3, **_GPT2)


def schedule_gpt2_n_inner_does_not_divide():
    _refused("GPT2LMHeadModel", "GPT2Config", world=4, **{**_GPT2, "n_inner": 66})


def schedule_bert_heads_do_not_divide():
    _refused("BertForMaskedLM", "BertConfig", world=3, num_hidden_layers=1, hidden_size=32,
             num_attention_heads=4, intermediate_size=64, vocab_size=64)


def schedule_bert_intermediate_size_does_not_divide():
    _refused("BertModel", "BertConfig", world=4, num_hidden_layers=1, hidden_size=32,
             num_attention_heads=4, intermediate_size=66, vocab_size=64)


def schedule_llama_heads_do_not_divide():
    _refused("LlamaForCausalLM", "LlamaConfig", world=4, num_attention_heads=6, **_LLAMA)


def schedule_llama_kv_heads_not_a_multiple_of_the_degree():
    _refused("LlamaForCausalLM", "LlamaConfig", world=2, num_attention_heads=6,
             num_key_value_heads=3, **_LLAMA)


def schedule_llama_kv_heads_not_a_divisor_of_the_degree():
    _refused("LlamaModel", "LlamaConfig", world=3, num_attention_heads=6,
             num_key_value_heads=2, **_LLAMA)


def schedule_llama_intermediate_size_does_not_divide():
    _refused("LlamaForCausalLM", "LlamaConfig", world=4, num_attention_heads=8,
             num_key_value_heads=2, **{**_LLAMA, "intermediate_size": 98})


def schedule_opt_heads_do_not_divide():
    _refused("OPTForCausalLM", "OPTConfig", world=3, num_hidden_layers=1, hidden_size=32,
             num_attention_heads=4, ffn_dim=64, vocab_size=64, word_embed_proj_dim=32)


def schedule_opt_ffn_dim_does_not_divide():
    _refused("OPTForCausalLM", "OPTConfig", world=4, num_hidden_layers=1, hidden_size=32,
             num_attention_heads=4, ffn_dim=66, vocab_size=64, word_embed_proj_dim=32)


def schedule_t5_heads_do_not_divide():
    _refused("T5ForConditionalGeneration", "T5Config", world=4, num_layers=1, d_model=32,
             d_kv=8, num_heads=6, d_ff=64, vocab_size=64)


def schedule_t5_d_ff_does_not_divide():
    _refused("T5Model", "T5Config", world=4, num_layers=1, d_model=32, d_kv=8, num_heads=4,
             d_ff=66, vocab_size=64)


def schedule_vit_heads_do_not_divide():
    _refused("ViTForImageClassification", "ViTConfig", world=3, num_hidden_layers=1,
             hidden_size=32, num_attention_heads=4, intermediate_size=64, image_size=16,
             patch_size=8)


def schedule_vit_intermediate_size_does_not_divide():
    _refused("ViTModel", "ViTConfig", world=4, num_hidden_layers=1, hidden_size=32,
             num_attention_heads=4, intermediate_size=66, image_size=16, patch_size=8)


def _heads(model: str, path: str, field: str, value: int, world: int, what: str) -> str:
    return (rf"sch\['{path}'\]\.schedules\.schedule_{model}\(\.\.\.\): tensor parallelism gives "
            rf"each of the {world} ranks {what}, and {field}={value} does not divide by "
            rf"{world}.*values: {field}={value}, tp_degree={world}.*fix: use a "
            rf"tensor-parallel group whose size divides {value} .*config\.{field} = ")


_FEATURES = r"an equal share of the (MLP's|feed-forward) features"

CASES: list[tuple[Callable, type, str]] = [
    (schedule_unknown_knob, tl.ScheduleError,
     r"sch\[''\]\.schedules\.apply_schedule\(\.\.\.\): unknown knob 'ckpt' for the built-in "
     r"schedule of GPT2LMHeadModel.*knobs=\['tp', 'sequence_parallel', 'ckpt_ratio', "
     r"'attention', 'fused', 'compile'\].*fix: apply_schedule\(sch, ckpt_ratio=0\.5\)"),
    (schedule_unknown_knob_without_a_near_name, tl.ScheduleError,
     r"unknown knob 'attention' for the built-in schedule of LlamaForCausalLM.*fix: drop "
     r"'attention'; the knobs of this schedule are tp, sequence_parallel, ckpt_ratio, "
     r"compile"),
    (schedule_gpt2_heads_do_not_divide, tl.ScheduleError,
     _heads("gpt2", r"transformer\.h\.\*\.attn", "n_head", 4, 3, "whole attention heads")
     + r"6"),
    (schedule_gpt2_n_inner_does_not_divide, tl.ScheduleError,
     _heads("gpt2", r"transformer\.h\.\*\.mlp", "n_inner", 66, 4, _FEATURES) + "68"),
    (schedule_bert_heads_do_not_divide, tl.ScheduleError,
     _heads("bert", r"bert\.encoder\.layer\.\*\.attention\.self", "num_attention_heads", 4, 3,
            "whole attention heads")),
    (schedule_bert_intermediate_size_does_not_divide, tl.ScheduleError,
     _heads("bert", r"encoder\.layer\.\*\.intermediate", "intermediate_size", 66, 4,
            _FEATURES)),
    (schedule_llama_heads_do_not_divide, tl.ScheduleError,
     _heads("llama", r"model\.layers\.\*\.self_attn", "num_attention_heads", 6, 4,
            "whole query heads") + "8"),
    (schedule_llama_kv_heads_not_a_multiple_of_the_degree, tl.ScheduleError,
     r"sch\['model\.layers\.\*\.self_attn'\]\.schedules\.schedule_llama\(\.\.\.\): .*whole KV "
     r"heads .*num_key_value_heads=3 is neither a multiple nor a divisor of 2.*fix: use a "
     r"tensor-parallel degree that divides num_key_value_heads \(\[1, 3\]\) or is a multiple "
     r"of it dividing num_attention_heads \(\[6\]\)"),
    (schedule_llama_kv_heads_not_a_divisor_of_the_degree, tl.ScheduleError,
     r"sch\['layers\.\*\.self_attn'\]\.schedules\.schedule_llama\(\.\.\.\): .*"
     r"num_key_value_heads=2 is neither a multiple nor a divisor of 3.*values: "
     r"num_key_value_heads=2, num_attention_heads=6, tp_degree=3.*\(\[1, 2\]\).*\(\[6\]\)"),
    (schedule_llama_intermediate_size_does_not_divide, tl.ScheduleError,
     _heads("llama", r"model\.layers\.\*\.mlp", "intermediate_size", 98, 4, _FEATURES)
     + "100"),
    (schedule_opt_heads_do_not_divide, tl.ScheduleError,
     _heads("opt", r"model\.decoder\.layers\.\*\.self_attn", "num_attention_heads", 4, 3,
            "whole attention heads")),
    (schedule_opt_ffn_dim_does_not_divide, tl.ScheduleError,
     _heads("opt", r"model\.decoder\.layers\.\*\.fc1", "ffn_dim", 66, 4, _FEATURES)),
    (schedule_t5_heads_do_not_divide, tl.ScheduleError,
     _heads("t5", r"encoder\.block\.\*\.layer\.0\.SelfAttention", "num_heads", 6, 4,
            "whole attention heads")),
    (schedule_t5_d_ff_does_not_divide, tl.ScheduleError,
     _heads("t5", r"encoder\.block\.\*\.layer\.\*\.DenseReluDense", "d_ff", 66, 4,
            _FEATURES)),
    (schedule_vit_heads_do_not_divide, tl.ScheduleError,
     _heads("vit", r"vit\.layers\.\*\.attention", "num_attention_heads", 4, 3,
            "whole attention heads")),
    (schedule_vit_intermediate_size_does_not_divide, tl.ScheduleError,
     _heads("vit", r"layers\.\*\.mlp", "intermediate_size", 66, 4, _FEATURES)),
]
