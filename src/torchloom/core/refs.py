"""References in recipes: which functions and classes a recipe read from a file may name.

A recipe stores a function or class argument (the factory of a ``replace``, the op of a
``sync``, the pattern function of a ``find``) by its import path, ``"module:qualname"``.
A recipe read from a file is untrusted data, so a reference in it resolves only to an
object of the **schedule allow-list**, never to anything that reads or writes files, opens
connections, compiles, imports or loads code, whatever module it lives in:

* ``nn.Module`` classes of ``torch.nn`` (``torch.nn.modules.linear:Linear``, ...);
* ``nn.Module`` classes of transformers' modelling code (``transformers.models.*``,
  ``transformers.activations``, ``transformers.pytorch_utils``,
  ``transformers.modeling_layers``): its models and layers;
* torchloom's own ops and schedule factories, each marked with :func:`schedule_safe`
  where it is defined (``torchloom.ops.fused:make_fused_gpt2_mlp``, ...) and every
  ``nn.Module`` class of ``torchloom.ops``;
* a named set of pure tensor functions: :data:`SAFE_FUNCTIONAL` of
  ``torch.nn.functional`` (activations, normalisations, dropout, linear, attention,
  losses) and :data:`SAFE_TORCH` of ``torch`` (arithmetic and shape functions).

Anything else (``torch.save``, ``torch.hub.load``, ``torch.utils.cpp_extension.load_inline``,
a class's methods such as ``Module.load_state_dict``, any function of transformers) is
refused unless the caller trusts it by name, ``trusted_refs={"module:qualname": obj}``, or
trusts the whole text, ``trust_code=True``. Resolving imports nothing outside torch,
torchloom and transformers, and of those only modules with public names (a private
module such as ``torch._C._nn`` is looked up only if it is imported already).

>>> import torch
>>> resolve_ref("torch.nn.modules.activation:GELU") is torch.nn.GELU
True
>>> resolve_ref("torch.serialization:save")
Traceback (most recent call last):
...
torchloom.core.errors.RecipeError: resolve_ref(...): the reference 'torch.serialization:save' is not trusted: it names a function of 'torch.serialization', which is not on the schedule allow-list (nn.Module classes of torch.nn, transformers' modelling code and torchloom.ops; torchloom's schedule factories; the pure tensor functions of SAFE_FUNCTIONAL and SAFE_TORCH)
    values: ref='torch.serialization:save'
    fix: if you trust it, pass the object: Recipe.from_json(text, trusted_refs={'torch.serialization:save': <the object>}) (or apply_recipe(model, text, trusted_refs=...)); trust_code=True trusts every reference
"""

from __future__ import annotations

import functools
import importlib
import inspect
import keyword
import sys
import types
from collections.abc import Mapping
from typing import Any, Callable, TypeGuard, TypeVar

import torch
from torch import nn

from .errors import RecipeError

__all__ = [
    "SAFE_FUNCTIONAL",
    "SAFE_TORCH",
    "import_ref",
    "is_schedule_safe",
    "ref_of",
    "resolve_ref",
    "schedule_safe",
]

#: Pure functions of ``torch.nn.functional`` a recipe may name: they compute tensors from
#: tensors and touch nothing else.
SAFE_FUNCTIONAL: tuple[str, ...] = (
    # activations
    "celu", "elu", "gelu", "glu", "hardshrink", "hardsigmoid", "hardswish", "hardtanh",
    "leaky_relu", "logsigmoid", "mish", "prelu", "relu", "relu6", "rrelu", "selu",
    "sigmoid", "silu", "softmax", "softmin", "log_softmax", "softplus", "softshrink",
    "softsign", "tanh", "tanhshrink", "threshold",
    # normalisation and dropout
    "batch_norm", "group_norm", "instance_norm", "layer_norm", "local_response_norm",
    "normalize", "rms_norm", "dropout", "dropout1d", "dropout2d", "dropout3d",
    "alpha_dropout", "feature_alpha_dropout",
    # linear algebra, attention, embeddings, convolutions and pooling
    "bilinear", "linear", "embedding", "one_hot", "scaled_dot_product_attention",
    "conv1d", "conv2d", "conv3d", "avg_pool1d", "avg_pool2d", "max_pool1d", "max_pool2d",
    "adaptive_avg_pool1d", "adaptive_avg_pool2d", "pad",
    # losses and distances
    "binary_cross_entropy", "binary_cross_entropy_with_logits", "cosine_similarity",
    "cross_entropy", "huber_loss", "kl_div", "l1_loss", "mse_loss", "nll_loss",
    "pairwise_distance", "smooth_l1_loss",
)

#: Pure functions of ``torch`` a recipe may name (arithmetic, reductions, shapes).
SAFE_TORCH: tuple[str, ...] = (
    "abs", "add", "addcmul", "addmm", "baddbmm", "bmm", "cat", "chunk", "clamp", "cos",
    "cumsum", "div", "einsum", "erf", "exp", "flatten", "layer_norm", "lerp", "log",
    "masked_fill", "matmul", "mean", "mm", "mul", "neg", "outer", "permute", "pow",
    "reciprocal", "relu", "reshape", "rsqrt", "sigmoid", "sin", "softmax", "split", "sqrt",
    "square", "stack", "sub", "sum", "tanh", "transpose", "tril", "triu", "where",
)

#: transformers modules whose ``nn.Module`` classes a recipe may name (prefixes).
TRANSFORMERS_MODULES = ("transformers.models.", "transformers.activations",
                        "transformers.pytorch_utils", "transformers.modeling_layers")

#: Packages a reference may import a (public) module of.
IMPORTABLE = ("torch", "torchloom", "transformers")

_MARKED: set[int] = set()  # ids of objects marked with schedule_safe (kept alive below)
_KEEP: list[Any] = []

T = TypeVar("T")


def schedule_safe(obj: T) -> T:
    """Mark a torchloom function or class as nameable by an untrusted recipe.

    Use it only on factories and ops that build or transform modules and tensors (they
    must not read or write files, open connections, compile, import or load code).

    >>> @schedule_safe
    ... def make_identity(old):
    ...     return old
    >>> is_schedule_safe(make_identity)
    True
    """
    _MARKED.add(id(obj))
    _KEEP.append(obj)
    return obj


@functools.cache
def _safe_functions() -> frozenset[int]:
    import torch.nn.functional as F

    objs = [getattr(F, n) for n in SAFE_FUNCTIONAL if hasattr(F, n)]
    objs += [getattr(torch, n) for n in SAFE_TORCH if hasattr(torch, n)]
    return frozenset(id(o) for o in objs)


def is_schedule_safe(obj: Any) -> bool:
    """Whether ``obj`` is on the schedule allow-list (see the module docstring).

    >>> import torch
    >>> is_schedule_safe(torch.nn.Linear), is_schedule_safe(torch.tanh)
    (True, True)
    >>> is_schedule_safe(torch.save), is_schedule_safe(torch.nn.Module.load_state_dict)
    (False, False)
    """
    if id(obj) in _MARKED or id(obj) in _safe_functions():
        return True
    if not (inspect.isclass(obj) and issubclass(obj, nn.Module)):
        return False
    module = getattr(obj, "__module__", None)
    if not isinstance(module, str) or obj.__name__.startswith("_"):
        return False
    return (module.startswith("torch.nn.") or module.startswith("torchloom.ops.")
            or module.startswith(TRANSFORMERS_MODULES))


# --------------------------------------------------------------------------- texts


def is_dotted(text: Any) -> TypeGuard[str]:
    """Whether ``text`` is a dotted name of Python identifiers (no keywords)."""
    return isinstance(text, str) and bool(text) and all(
        part.isidentifier() and not keyword.iskeyword(part) for part in text.split("."))


def is_dunder(name: str) -> bool:
    """Whether ``name`` is a ``__dunder__`` name."""
    return name.startswith("__") and name.endswith("__")


def short_repr(value: Any, limit: int = 80) -> str:
    """A one-line repr of ``value``, at most ``limit`` characters."""
    try:
        text = repr(value).replace("\n", " ")
    except Exception:  # noqa: BLE001 - a value whose repr fails is still named
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Refused(Exception):
    """A reference, value or entry a recipe may not hold: the problem, values and fix."""

    def __init__(self, problem: str, values: dict[str, Any] | None = None,
                 fix: str | None = None) -> None:
        super().__init__(problem)
        self.problem, self.values, self.fix = problem, dict(values or {}), fix


# --------------------------------------------------------------------------- references


def _loaded(module_name: str, qualname: str) -> Any:
    """The object at ``module:qualname`` if its module is imported already, else None.
    Imports nothing."""
    obj: Any = sys.modules.get(module_name)
    try:
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        return None
    return obj


def ref_of(obj: Any) -> str | None:
    """The import path ``"module:qualname"`` of a function or class, or None if ``obj``
    cannot be found again by that path (lambdas, local functions, instances). Imports
    nothing: the object's module must be imported already (it is, if the object exists).

    >>> ref_of(torch.nn.Linear)
    'torch.nn.modules.linear:Linear'
    >>> ref_of(lambda x: x) is None
    True
    """
    if not callable(obj) or isinstance(obj, nn.Module) or isinstance(obj, functools.partial):
        return None
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not is_dotted(module) or not is_dotted(qualname):
        return None  # "<lambda>", "f.<locals>.g", a missing or odd name
    if module not in sys.modules or _loaded(module, qualname) is not obj:
        return None
    return f"{module}:{qualname}"


def import_ref(ref: str) -> Any:
    """Import the object named by ``"module:qualname"``, whatever it is.

    This runs the named module's code: use it only for references you trust.
    :meth:`~torchloom.Recipe.from_json` calls it only with ``trust_code=True``; otherwise
    it resolves references with :func:`resolve_ref`.

    >>> import_ref("torch.nn:Linear") is torch.nn.Linear
    True
    """
    module_name, _, qualname = ref.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, ValueError) as exc:
        raise RecipeError(
            f"cannot import {ref!r}: {exc}",
            primitive="apply_recipe",
            values={"ref": ref},
            fix="make the function or class importable under that name, or edit the recipe",
        ) from exc
    return obj


def trust_fix(ref: str) -> str:
    """The fix text of an untrusted reference."""
    return (f"if you trust it, pass the object: Recipe.from_json(text, trusted_refs="
            f"{{{ref!r}: <the object>}}) (or apply_recipe(model, text, trusted_refs=...)); "
            "trust_code=True trusts every reference")


def check_trusted(trusted_refs: Any, primitive: str) -> None:
    """Raise :class:`RecipeError` unless ``trusted_refs`` is None or a mapping."""
    if trusted_refs is not None and not isinstance(trusted_refs, Mapping):
        raise RecipeError(
            f"trusted_refs must map reference texts to objects, not a "
            f"{type(trusted_refs).__name__}", primitive=primitive,
            values={"trusted_refs": short_repr(trusted_refs)},
            fix="trusted_refs={'mypackage.kernels:make_fused_mlp': make_fused_mlp}, or "
            "sch.recipe.references() for a recipe recorded in this process")


_MISSING = object()
_ALLOW_LIST = ("nn.Module classes of torch.nn, transformers' modelling code and "
               "torchloom.ops; torchloom's schedule factories; the pure tensor functions of "
               "SAFE_FUNCTIONAL and SAFE_TORCH")


def _module(module_name: str, ref: str) -> Any:
    """The module of a reference: imported only if it is public and in :data:`IMPORTABLE`."""
    if module_name.split(".")[0] not in IMPORTABLE:
        raise Refused(
            f"the reference {ref!r} is not trusted: its module {module_name!r} is outside "
            "torch, torchloom and transformers, and a recipe imports nothing else",
            {"ref": ref}, trust_fix(ref))
    loaded = sys.modules.get(module_name)
    if loaded is not None:
        return loaded
    if any(part.startswith("_") for part in module_name.split(".")):
        raise Refused(
            f"the reference {ref!r} is not trusted: its module {module_name!r} is private "
            "and not imported, and a recipe imports only public modules",
            {"ref": ref}, trust_fix(ref))
    try:
        return importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is a bad reference
        raise Refused(f"cannot import module {module_name!r} of {ref!r}: "
                      f"{short_repr(exc, 200)}", {"ref": ref},
                      "edit the reference to name an existing module") from None


def resolve_untrusted(ref: Any, trusted_refs: Mapping[str, Any] | None,
                      trust_code: bool) -> Any:
    """:func:`resolve_ref`, raising :class:`Refused`."""
    module_name, _, qualname = ref.partition(":") if isinstance(ref, str) else ("", "", "")
    if not (is_dotted(module_name) and is_dotted(qualname)) or \
            any(is_dunder(p) for p in [*module_name.split("."), *qualname.split(".")]):
        # (a dunder module such as a package's __main__ may run a program when imported)
        raise Refused(f"a reference must be 'package.module:Name' (no dunder names), not "
                      f"{short_repr(ref)}",
                      {"ref": short_repr(ref)},
                      "write a reference as recipe.to_json() does, e.g. "
                      "{'__ref__': 'torch.nn.modules.linear:Linear'}")
    if trusted_refs and ref in trusted_refs:
        return trusted_refs[ref]
    if trust_code:
        try:
            return import_ref(ref)
        except RecipeError as exc:
            raise Refused(exc.problem, {"ref": ref}, exc.fix) from exc
    obj = _module(module_name, ref)
    parts = qualname.split(".")
    for number, part in enumerate(parts):
        if part.startswith("_"):
            raise Refused(f"the reference {ref!r} names a private attribute {part!r}",
                          {"ref": ref}, trust_fix(ref))
        if number == 0:  # an attribute of the module (a lazy module may import here)
            try:
                value = getattr(obj, part, _MISSING)
            except Exception as exc:  # noqa: BLE001 - a lazy import that fails
                raise Refused(f"cannot find {part!r} of the reference {ref!r}: "
                              f"{short_repr(exc, 200)}", {"ref": ref},
                              "edit the reference to name an existing class") from None
        else:  # an attribute of a class, without running descriptors
            value = inspect.getattr_static(obj, part, _MISSING)
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
        if value is _MISSING:
            raise Refused(f"cannot find {part!r} of the reference {ref!r}", {"ref": ref},
                          "edit the reference to name an existing class or function")
        if isinstance(value, types.ModuleType) or (number < len(parts) - 1
                                                   and not inspect.isclass(value)):
            raise Refused(
                f"the reference {ref!r} goes through {part!r}, a "
                f"{type(value).__name__}: a reference names a class or function of its "
                "module (or a class's attribute)", {"ref": ref}, trust_fix(ref))
        obj = value
    if not (inspect.isclass(obj) or inspect.isroutine(obj)):
        raise Refused(
            f"the reference {ref!r} is not trusted: it resolves to a {type(obj).__name__}, "
            "not a class or function", {"ref": ref}, trust_fix(ref))
    if not is_schedule_safe(obj):
        kind = "class" if inspect.isclass(obj) else "function"
        raise Refused(
            f"the reference {ref!r} is not trusted: it names a {kind} of "
            f"{getattr(obj, '__module__', None) or module_name!r}, which is not on the "
            f"schedule allow-list ({_ALLOW_LIST})", {"ref": ref}, trust_fix(ref))
    return obj


def resolve_ref(ref: str, trusted_refs: Mapping[str, Any] | None = None, *,
                trust_code: bool = False) -> Any:
    """The object a recipe's ``{"__ref__": "module:qualname"}`` names, if it is trusted.

    Trusted, in order: the objects of ``trusted_refs`` (keyed by the reference text);
    anything at all with ``trust_code=True`` (the module is imported: its code runs);
    otherwise an object of the schedule allow-list (:func:`is_schedule_safe`), reached
    from a public module of torch, torchloom or transformers (or one imported already)
    through classes only. A module outside those packages is never imported.

    >>> resolve_ref("os:system")
    Traceback (most recent call last):
    ...
    torchloom.core.errors.RecipeError: resolve_ref(...): the reference 'os:system' is not trusted: its module 'os' is outside torch, torchloom and transformers, and a recipe imports nothing else
        values: ref='os:system'
        fix: if you trust it, pass the object: Recipe.from_json(text, trusted_refs={'os:system': <the object>}) (or apply_recipe(model, text, trusted_refs=...)); trust_code=True trusts every reference
    """
    check_trusted(trusted_refs, "resolve_ref")
    try:
        return resolve_untrusted(ref, trusted_refs, trust_code)
    except Refused as exc:
        raise RecipeError(exc.problem, primitive="resolve_ref", values=exc.values,
                          fix=exc.fix) from None


def takes_references(primitive: str) -> dict[str, str]:
    """The parameters of ``primitive`` that may hold a reference in an untrusted recipe,
    each with where: ``"value"`` (the argument itself) or ``"pattern"`` (the ``pattern``
    of a recorded match). Every other argument is plain data."""
    return _REF_PARAMS.get(primitive, {})


_REF_PARAMS: dict[str, dict[str, str]] = {
    "replace": {"new_mod_or_fn": "value", "target_ops": "pattern"},
    "replace_all": {"module_type": "value", "make_mod_fn": "value"},
    "sync": {"sync_op_or_fn": "value"},
    "compile": {"backend": "value"},
    "fuse": {"subgraph": "pattern", "compiler": "value"},
    "checkpoint": {"subgraph": "pattern"},
}


def check_reference_places(primitive: str, bound: Mapping[str, Any],
                           trusted: Callable[[Any], bool]) -> None:
    """Raise :class:`Refused` when a function or class sits in an argument of
    ``primitive`` that takes plain data (``concrete_args``, ``annotate``'s value, ...),
    unless ``trusted(obj)`` says the caller trusted that object by name."""
    places = takes_references(primitive)
    for name, value in bound.items():
        where = places.get(name)
        if where == "value":
            continue
        if where == "pattern" and isinstance(value, dict):
            value = {k: v for k, v in value.items() if k != "pattern"}
        if _untrusted_code(value, trusted):
            allowed = ", ".join(places) or "none"
            raise Refused(
                f"argument {name!r} of {primitive} takes plain data, and this recipe puts a "
                "function or class there", {"primitive": primitive, "argument": name,
                                            "takes_references": allowed},
                f"write {name!r} as numbers, strings, lists and dicts; references are "
                f"accepted only in: {allowed}")


def _untrusted_code(value: Any, trusted: Callable[[Any], bool], depth: int = 0) -> bool:
    """Whether a decoded recipe value holds, anywhere, a function or class that
    ``trusted`` does not vouch for (nesting past 64 levels counts as such)."""
    if depth > 64:
        return True
    if isinstance(value, (list, tuple)):
        return any(_untrusted_code(v, trusted, depth + 1) for v in value)
    if isinstance(value, dict):
        return any(_untrusted_code(v, trusted, depth + 1) for v in value.values())
    return callable(value) and not trusted(value)
