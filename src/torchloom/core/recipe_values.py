"""What a recipe line may hold: its argument values and the fields of its call.

Values are data (``None``, booleans, numbers, strings, lists, tuples, string-keyed dicts,
``torch.dtype``) or references to module-level functions and classes
(:mod:`torchloom.core.refs`), nested at most :data:`MAX_DEPTH` deep. This module encodes
them for JSON (:func:`_encode`), decodes them back (:func:`_decode`), renders them as
Python source (:func:`_python`), and checks the fields of a call (:func:`_check_fields`: a
registered primitive, a string path, a list of arguments, identifier keywords) and where
references sit (:func:`_check_places`). The recipe (:mod:`torchloom.core.recipe_data`)
and the script reader (:mod:`torchloom.core.recipe_script`) build on it.

>>> _encode({"dtype": torch.float16, "sizes": (1, 2)})
{'dtype': {'__dtype__': 'float16'}, 'sizes': {'__tuple__': [1, 2]}}
>>> _decode({"__tuple__": [1, 2]}, resolve=lambda ref: None)
(1, 2)
>>> imports: set[str] = set()
>>> _python([torch.bfloat16, float("inf")], imports), imports
("[torch.bfloat16, float('inf')]", {'torch'})
"""

from __future__ import annotations

import keyword
import math
from collections.abc import Mapping
from typing import Any, Callable

import torch

from .primitive_table import PRIMITIVES, list_primitives
from .refs import Refused, check_reference_places, is_dunder, ref_of, short_repr

__all__ = ["MAX_DEPTH"]

#: The deepest nesting of lists, tuples and dicts a recipe argument may have.
MAX_DEPTH = 20

_DTYPES: dict[str, torch.dtype] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}


class _Unserialisable(Exception):
    """Raised for a value a recipe cannot write as data (kept in memory only)."""

    def __init__(self, value: Any) -> None:
        super().__init__(value)
        self.value = value


def _encode(value: Any, depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        raise _Unserialisable(value)
    if value is None or type(value) in (bool, int, float, str):
        return value
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, list):
        return [_encode(v, depth + 1) for v in value]
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, depth + 1) for v in value]}
    if isinstance(value, dict):
        if not all(type(k) is str for k in value):
            raise _Unserialisable(value)
        if any(is_dunder(k) for k in value):
            raise _Unserialisable(value)
        return {k: _encode(v, depth + 1) for k, v in value.items()}
    ref = ref_of(value)
    if ref is not None:
        return {"__ref__": ref}
    raise _Unserialisable(value)


def _decode(value: Any, resolve: Callable[[str], Any], depth: int = 0) -> Any:
    """A JSON value back to Python; raises ``Refused`` for anything ``_encode`` does not
    write, for nesting deeper than ``MAX_DEPTH``, and for untrusted references."""
    if depth > MAX_DEPTH:
        raise Refused(f"an argument is nested deeper than {MAX_DEPTH} levels",
                       {"max_depth": MAX_DEPTH}, "flatten the argument")
    if value is None or type(value) in (bool, int, float, str):
        return value
    if type(value) is list:
        return [_decode(v, resolve, depth + 1) for v in value]
    if type(value) is not dict:
        raise Refused(f"a {type(value).__name__} is not a recipe value", {},
                       "write the recipe with sch.recipe.to_json()")
    special = [k for k in value if is_dunder(k)]
    if not special:
        return {k: _decode(v, resolve, depth + 1) for k, v in value.items()}
    if len(value) != 1:
        raise Refused(f"the special key {special[0]!r} must be alone in its object",
                       {"keys": sorted(value)[:8]}, "write the recipe with sch.recipe.to_json()")
    key, inner = special[0], value[special[0]]
    if key == "__dtype__":
        if not isinstance(inner, str) or inner not in _DTYPES:
            raise Refused(f"unknown dtype {short_repr(inner)}", {"dtype": short_repr(inner)},
                           "use a torch dtype name, e.g. {'__dtype__': 'float16'}")
        return _DTYPES[inner]
    if key == "__tuple__":
        if type(inner) is not list:
            raise Refused("'__tuple__' must hold a list", {"value": short_repr(inner)},
                           "write {'__tuple__': [1, 2]}")
        return tuple(_decode(v, resolve, depth + 1) for v in inner)
    if key == "__ref__":
        return resolve(inner)
    raise Refused(f"unknown special key {key!r}", {"key": key},
                   "use only '__dtype__', '__tuple__' and '__ref__'")


def _check_depth(value: Any, depth: int = 0) -> None:
    """Raise ``Refused`` when an in-memory argument nests deeper than ``MAX_DEPTH``
    (a list that contains itself, say)."""
    if depth > MAX_DEPTH:
        raise Refused(f"an argument is nested deeper than {MAX_DEPTH} levels",
                       {"max_depth": MAX_DEPTH}, "flatten the argument")
    if isinstance(value, (list, tuple)):
        for v in value:
            _check_depth(v, depth + 1)
    elif isinstance(value, dict):
        for v in value.values():
            _check_depth(v, depth + 1)


def _python(value: Any, imports: set[str], depth: int = 0) -> str:
    """Render a value as Python source, collecting the imports it needs. Only values that
    are data are rendered (by ``repr`` for scalars and strings); anything else raises
    ``_Unserialisable``."""
    if depth > MAX_DEPTH:
        raise _Unserialisable(value)
    if isinstance(value, torch.dtype):
        imports.add("torch")
        return f"torch.{str(value).removeprefix('torch.')}"
    if isinstance(value, list):
        return "[" + ", ".join(_python(v, imports, depth + 1) for v in value) + "]"
    if isinstance(value, tuple):
        inner = ", ".join(_python(v, imports, depth + 1) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, dict) and all(type(k) is str for k in value):
        return "{" + ", ".join(f"{k!r}: {_python(v, imports, depth + 1)}"
                               for k, v in value.items()) + "}"
    if type(value) is float and not math.isfinite(value):
        return f"float({str(value)!r})"
    if value is None or type(value) in (bool, int, float, str):
        return repr(value)
    ref = ref_of(value)
    if ref is not None:  # both halves are dotted identifiers (ref_of checks)
        module, _, qualname = ref.partition(":")
        imports.add(module)
        return f"{module}.{qualname}"
    raise _Unserialisable(value)


# --------------------------------------------------------------------------- fields


def _check_fields(primitive: Any, path: Any, args: Any, kwargs: Any) -> None:
    """Raise ``Refused`` unless the fields make a call a recipe may hold: a registered
    primitive, a string path, a list or tuple of arguments, keywords that are public
    Python identifiers."""
    names = list_primitives()
    if not isinstance(primitive, str) or primitive not in names:
        raise Refused(f"unknown primitive {short_repr(primitive)}",
                       {"primitive": _shown(primitive)},
                       f"use one of the primitives: {', '.join(names)}")
    if not isinstance(path, str):
        raise Refused(f"the path must be a string, not a {type(path).__name__}",
                       {"primitive": primitive, "path": _shown(path)},
                       "write the schedule path as a string, e.g. 'transformer.h.0.mlp'")
    if not isinstance(args, (list, tuple)):
        raise Refused(f"args of {primitive} must be a list, not a {type(args).__name__}",
                       {"primitive": primitive, "args": short_repr(args)},
                       f"wrap the arguments in a list, e.g. \"args\": [{short_repr(args)}]")
    if not isinstance(kwargs, dict):
        raise Refused(f"kwargs of {primitive} must be an object (a dict), not a "
                       f"{type(kwargs).__name__}",
                       {"primitive": primitive, "kwargs": short_repr(kwargs)},
                       "write keywords as an object, e.g. \"kwargs\": {\"ratio\": 0.5}")
    for name in kwargs:
        if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name) \
                or is_dunder(name):
            raise Refused(f"{short_repr(name)} is not a keyword {primitive} can take",
                           {"primitive": primitive, "keyword": _shown(name)},
                           "use the keyword names of the primitive's signature")


def _check_places(primitive: str, args: tuple[Any, ...] | list[Any], kwargs: dict[str, Any],
                  trusted_refs: Mapping[str, Any] | None, trust_code: bool) -> None:
    """Raise ``Refused`` when a reference of an untrusted recipe sits in an argument that
    takes plain data (see :func:`~torchloom.core.refs.takes_references`)."""
    if trust_code:
        return
    try:
        bound = PRIMITIVES[primitive].signature.bind(*args, **kwargs)
    except TypeError:
        return  # apply_recipe names the misfit when it checks the line
    trusted = {id(v) for v in (trusted_refs or {}).values()}
    check_reference_places(primitive, bound.arguments, lambda obj: id(obj) in trusted)


def _shown(value: Any) -> Any:
    """A value as an error shows it: short scalars and strings as they are, anything else
    as a short repr."""
    if value is None or type(value) in (bool, int, float) or \
            (type(value) is str and len(value) <= 80):
        return value
    return short_repr(value)
