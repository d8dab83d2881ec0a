"""Post-passes on a traced graph: dropout follows the ``training`` flag, and
:func:`clean_graph` (dead-code elimination that keeps guards)."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from .guards import _guard_cache, _train_only, is_guard

_DROPOUT_FNS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
                F.feature_alpha_dropout}


def _follow_training_flag(graph: fx.Graph) -> None:
    """Make dropout nodes traced in training mode follow ``self.training`` at run time."""
    training: fx.Node | None = None

    def flag(before: fx.Node) -> fx.Node:
        nonlocal training
        if training is None:
            first = next(n for n in graph.nodes if n.op != "placeholder")
            with graph.inserting_before(first):
                training = graph.get_attr("training")
        return training

    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in _DROPOUT_FNS:
            if node.kwargs.get("training") is True:
                node.update_kwarg("training", flag(node))
            elif len(node.args) >= 3 and node.args[2] is True:
                node.update_arg(2, flag(node))
        elif node.target is torch.dropout and len(node.args) >= 3 and node.args[2] is True:
            node.update_arg(2, flag(node))
        elif node.target is _guard_cache and isinstance(node.args[3], bool):
            node.update_arg(3, flag(node))  # a nested graph inlined by flatten=True
        elif node.target is F.scaled_dot_product_attention:
            p = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
            if isinstance(p, (int, float)) and p > 0:
                with graph.inserting_before(node):
                    gated = graph.call_function(_train_only, (p, flag(node)))
                if "dropout_p" in node.kwargs:
                    node.update_kwarg("dropout_p", gated)
                else:
                    node.update_arg(4, gated)


def clean_graph(gm: fx.GraphModule) -> None:
    """Dead-code elimination that keeps guards and side effects, then lint and recompile."""
    gm.graph.eliminate_dead_code(is_impure_node=lambda n: is_guard(n) or n.is_impure())
    gm.graph.lint()
    gm.recompile()
