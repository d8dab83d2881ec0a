"""Test helpers for users and for torchloom's own tests.

:func:`verify_recipe_roundtrip` is the one check every primitive's tests run: a recipe
must serialise, parse, print as a script (which parses back to the same calls: nothing
is ``exec``'d), and replay on a fresh model to the same schedule (same recipe, same
module structure, same parameter names, shapes and metadata, same outputs).

>>> import torch, torchloom as tl
>>> def make():
...     torch.manual_seed(0)
...     return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
>>> sch = tl.create_schedule(make())
>>> sch["0"].annotate("weight", "note", "x")
>>> verify_recipe_roundtrip(sch, make, (torch.ones(2, 4),))
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ..core.marks import SYNCS, get_mark, marks_of
from ..core.meta import get_meta, has_meta
from ..core.outputs import tensors_in
from ..core.recipe import Recipe, apply_recipe
from ..core.schedule import Schedule

__all__ = ["verify_recipe_roundtrip", "structure_of"]


def structure_of(model: nn.Module) -> dict[str, Any]:
    """What two equally scheduled models must share: module classes per path, the
    state-dict keys and shapes, tensor metadata, syncs and primitive marks."""
    modules = {name: type(m).__name__ for name, m in model.named_modules()}
    tensors = {}
    for name, t in model.state_dict(keep_vars=True).items():
        meta = get_meta(t) if has_meta(t) else None
        tensors[name] = (
            tuple(t.shape),
            t.dtype,
            meta.shard if meta else None,
            tuple(sorted(meta.tags.items())) if meta else (),
        )
    marks = {
        name: tuple(sorted(k for k in marks_of(m) if k != SYNCS))
        + tuple(s.describe() for s in get_mark(m, SYNCS, []))
        for name, m in model.named_modules()
    }
    return {"modules": modules, "tensors": tensors, "marks": marks}


def _run(model: nn.Module, inputs: tuple | dict) -> Any:
    with torch.no_grad():
        return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def verify_recipe_roundtrip(
    sch: Schedule,
    model_factory: Callable[[], nn.Module],
    example_inputs: tuple | dict | None = None,
) -> None:
    """Assert that ``sch.recipe`` survives JSON, printing and replay on ``model_factory()``.

    ``model_factory`` must build a model equal to the one ``sch`` was made from (same
    class and config; weights are copied across before outputs are compared). The printed
    script is checked without executing it: :meth:`~torchloom.Recipe.from_script` reads
    it as data (the functions and classes it names must be the ones ``sch`` recorded, or
    trusted ones) and the calls it holds are replayed on a fresh model.
    """
    recipe = sch.recipe
    trusted = recipe.references()  # the functions and classes this process recorded
    text = recipe.to_json()
    parsed = Recipe.from_json(text, trusted_refs=trusted)
    assert parsed == recipe, "JSON round trip changed the recipe"
    assert parsed.to_json() == text, "re-serialised JSON differs"

    replayed = apply_recipe(model_factory(), parsed, group=sch.group)
    assert replayed.recipe == recipe, "replay recorded a different recipe"
    assert str(replayed.recipe) == str(recipe), "replayed recipe prints differently"
    assert structure_of(replayed.mod) == structure_of(sch.mod), "replay built another structure"

    # The printed script, read without running it: each line must parse to the recorded
    # call (names it imports, literal values), and replaying those calls the way the script
    # would run them (sch = create_schedule(model); sch[path].primitive(...)) must build
    # the same schedule.
    script = Recipe.from_script(str(recipe), trusted_refs=trusted)
    assert script == recipe, "the printed script holds a different recipe"
    scripted = apply_recipe(model_factory(), script)
    assert scripted.recipe == recipe, "the printed script records a different recipe"
    assert structure_of(scripted.mod) == structure_of(sch.mod), "the script built another structure"

    if example_inputs is not None:
        replayed.mod.load_state_dict(sch.mod.state_dict())
        was_training = sch.mod.training
        sch.mod.eval()
        replayed.mod.eval()
        try:
            expected = tensors_in(_run(sch.mod, example_inputs))[0]
            actual = tensors_in(_run(replayed.mod, example_inputs))[0]
        finally:
            sch.mod.train(was_training)
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)
