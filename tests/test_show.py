"""Tests of the schedule tree rendering (``print(sch)``): collapsing of identical layers,
primitives at the node they were applied to, shard shapes, removed paths, and the rich
version."""

from __future__ import annotations

import io

import pytest
import torch
from rich.console import Console

import torchloom as tl
from torchloom.apps.cli import apply_demo_schedule
from torchloom.core.show import render_tree, rich_tree
from torchloom.schedules import zoo


def gpt2_schedule(n_layer: int = 4) -> tl.Schedule:
    return tl.create_schedule(zoo.make_model("gpt2", n_layer=n_layer, seed=0))


def lines_after(lines: list[str], start: int, needle: str) -> int:
    """Index of the first line at or after ``start`` that contains ``needle``."""
    for index in range(start, len(lines)):
        if needle in lines[index]:
            return index
    raise AssertionError(f"{needle!r} not found after line {start}")


def test_identical_layers_collapse_into_one_line():
    text = render_tree(gpt2_schedule(4))
    assert "h.0 .. h.3: GPT2Block x4" in text
    assert "h.1" not in text
    assert text.count("attn: GPT2Attention") == 1  # the sub-tree is drawn once
    assert text.splitlines()[0] == "GPT2LMHeadModel (63.2K params)"
    assert "c_attn: Conv1D  weight[32, 96] bias[96]" in text


def test_print_schedule_is_render_tree():
    sch = gpt2_schedule(2)
    assert str(sch) == "\n".join([
        "GPT2LMHeadModel (37.8K params)",
        "├── transformer: GPT2Model",
        "│   ├── wte: Embedding  weight[256, 32]",
        "│   ├── wpe: Embedding  weight[128, 32]",
        "│   ├── drop: Dropout",
        "│   ├── h: ModuleList",
        "│   │   └── h.0 .. h.1: GPT2Block x2",
        "│   │       ├── ln_1: LayerNorm  weight[32] bias[32]",
        "│   │       ├── attn: GPT2Attention",
        "│   │       │   ├── c_attn: Conv1D  weight[32, 96] bias[96]",
        "│   │       │   ├── c_proj: Conv1D  weight[32, 32] bias[32]",
        "│   │       │   ├── attn_dropout: Dropout",
        "│   │       │   └── resid_dropout: Dropout",
        "│   │       ├── ln_2: LayerNorm  weight[32] bias[32]",
        "│   │       └── mlp: GPT2MLP",
        "│   │           ├── c_fc: Conv1D  weight[32, 128] bias[128]",
        "│   │           ├── c_proj: Conv1D  weight[128, 32] bias[32]",
        "│   │           ├── act: NewGELUActivation",
        "│   │           └── dropout: Dropout",
        "│   └── ln_f: LayerNorm  weight[32] bias[32]",
        "└── lm_head: Linear  weight[256, 32]",
    ])
    assert str(sch["transformer.h"]).splitlines()[0] == "transformer.h: ModuleList"


def test_a_primitive_on_one_layer_breaks_the_run_and_sits_at_its_node():
    sch = gpt2_schedule(4)
    sch["transformer.h.2.mlp"].annotate("c_fc.weight", "tag", 1)
    lines = render_tree(sch).splitlines()
    assert any(line.endswith("h.0 .. h.1: GPT2Block x2") for line in lines)
    block = lines_after(lines, 0, "h.2: GPT2Block")
    mlp = lines_after(lines, block, "mlp: GPT2MLP")
    assert lines[mlp + 1].endswith("├── ◆ .annotate('c_fc.weight', 'tag', 1)")
    # one level deeper than the mlp line, before the mlp's children
    assert lines[mlp + 1].index("◆") == lines[mlp].index("mlp") + 4
    assert lines[mlp + 2].endswith("c_fc: Conv1D  weight[32, 128] bias[128]")
    assert any(line.endswith("h.3: GPT2Block") for line in lines)
    assert sum("◆" in line for line in lines) == 1


def test_same_primitive_on_every_layer_still_collapses():
    sch = gpt2_schedule(4)
    sch["transformer.h.*.attn"].annotate("c_attn.weight", "tag", 1)
    text = render_tree(sch)
    assert "h.0 .. h.3: GPT2Block x4" in text
    assert text.count("◆ .annotate('c_attn.weight', 'tag', 1)") == 1


def test_checkpoint_ratio_shows_on_the_module_list():
    sch = gpt2_schedule(4)
    sch["transformer.h"].checkpoint(ratio=0.5)
    lines = render_tree(sch).splitlines()
    h = lines_after(lines, 0, "h: ModuleList")
    assert lines[h + 1].endswith("├── ◆ .checkpoint(ratio=0.5)")
    assert lines[h + 2].endswith("└── h.0 .. h.3: GPT2Block x4")


def test_primitives_in_recipe_order_and_sharded_shapes():
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU())
    sch = tl.create_schedule(model)
    sch["0"].shard("weight", 0)
    sch["0"].annotate("weight", "note", "x")
    assert render_tree(sch) == "\n".join([
        "Sequential (30 params)",
        "├── 0: Linear  weight[6 of 6, 4] bias[6]",
        "│   ├── ◆ .shard('weight', 0)",
        "│   └── ◆ .annotate('weight', 'note', 'x')",
        "└── 1: ReLU",
    ])


def test_a_removed_path_is_shown_at_its_nearest_ancestor():
    sch = gpt2_schedule(2)
    sch["transformer.h.1.attn.c_attn"].annotate("weight", "tag", 1)
    sch["transformer.h.1.attn"].replace(torch.nn.Identity())
    lines = render_tree(sch).splitlines()
    attn = lines_after(lines, lines_after(lines, 0, "h.1: GPT2Block"), "attn: Identity")
    assert lines[attn + 1].endswith(
        "◆ sch['transformer.h.1.attn.c_attn'].annotate('weight', 'tag', 1)"
        "  (path no longer in the tree)")
    assert lines[attn + 2].endswith("◆ .replace(...)")


def test_a_subtree_shows_only_its_own_primitives():
    sch = gpt2_schedule(2)
    sch["transformer.h.0.mlp"].annotate("c_fc.weight", "tag", 1)
    sch["lm_head"].annotate("weight", "tag", 2)
    text = str(sch["transformer.h.0"])
    assert text.splitlines()[0] == "transformer.h.0: GPT2Block"
    assert "◆ .annotate('c_fc.weight', 'tag', 1)" in text
    assert "'tag', 2" not in text


def test_rich_tree_has_the_same_content():
    sch = gpt2_schedule(3)
    sch["transformer.h"].checkpoint(ratio=0.5)
    buffer = io.StringIO()
    Console(file=buffer, width=200, color_system=None).print(rich_tree(sch))
    rendered = [line.rstrip() for line in buffer.getvalue().splitlines()]
    assert rendered == render_tree(sch).splitlines()


@pytest.mark.parametrize("name", zoo.list_models())
def test_every_zoo_model_renders_and_trains_under_the_demo_schedule(name):
    model = zoo.make_model(name, seed=0)
    sch = tl.create_schedule(model)
    apply_demo_schedule(sch, name, 0.5)
    text = render_tree(sch)
    assert text.count("◆ .checkpoint(ratio=0.5)") == len(zoo.layer_paths(name))
    if name == "t5":  # T5's first block alone holds the relative position bias
        assert "block.0: T5Block" in text and "block.1: T5Block" in text
    else:  # the two layers are drawn once
        assert " x2" in text
    model, _ = tl.build(sch)
    loss = model(**zoo.example_inputs(name, model, batch_size=2, seq_len=8)).loss
    loss.backward()
    assert torch.isfinite(loss)
