"""The lowest layer: the schedule tree, the recipe, the primitive registry, the errors, the
metadata primitives leave on tensors and modules. Imports nothing else of torchloom."""

__version__ = "0.1.0"
