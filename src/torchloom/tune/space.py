"""A search space of named symbols whose candidates may depend on earlier symbols.

A :class:`Space` is an ordered list of :class:`Symbol` s. Each symbol has a list of
candidate values, or a function of the values fixed so far (a dict) that returns that
list: this is the dependent ("polyhedral") space of Slapo, written without Slapo's
partially-fixed symbol objects. Constraints are plain functions of a complete point that
return True to keep it.

Points are enumerated depth-first: the first symbol varies slowest, each symbol's values
in the order given. Values must be JSON scalars (``int``, ``float``, ``str``, ``bool``,
``None``) so that a point has one canonical JSON text (:func:`point_key`), which is its
key in the results database.

>>> space = Space()
>>> bs = space.create_symbol("batch_size", [8, 16, 32])
>>> ratio = space.create_symbol(
...     "ckpt_ratio", lambda p: [0.5, 1.0] if p["batch_size"] >= 32 else [0.0, 0.5, 1.0])
>>> space.add_constraint(lambda p: p["batch_size"] * (1 - p["ckpt_ratio"]) <= 8)
>>> space.count()
6
>>> [tuple(p.values()) for p in space.enumerate()]
[(8, 0.0), (8, 0.5), (8, 1.0), (16, 0.5), (16, 1.0), (32, 1.0)]
>>> point_key({"ckpt_ratio": 0.5, "batch_size": 16})
'{"batch_size":16,"ckpt_ratio":0.5}'
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from ..core.errors import TuneError

__all__ = ["Point", "Space", "Symbol", "point_key"]

Point = dict[str, Any]
Values = Sequence[Any] | Callable[[Mapping[str, Any]], Sequence[Any]]

_SCALARS = (bool, int, float, str, type(None))


def point_key(point: Mapping[str, Any]) -> str:
    """The canonical JSON text of a point: keys sorted, no spaces.

    >>> point_key({"b": 1, "a": "x"})
    '{"a":"x","b":1}'
    """
    return json.dumps(dict(point), sort_keys=True, separators=(",", ":"))


def _check_value(name: str, value: Any, where: str) -> None:
    bad = not isinstance(value, _SCALARS) or (isinstance(value, float) and not math.isfinite(value))
    if bad:
        raise TuneError(
            f"symbol {name!r} has a candidate value that is not a finite JSON scalar",
            primitive=where,
            values={"symbol": name, "value": value, "type": type(value).__name__},
            fix="use int, float, str, bool or None values, e.g. a kernel's name instead of "
            "the kernel: space.create_symbol('attn', ['eager', 'sdpa'])",
        )


class Symbol:
    """One named knob of a :class:`Space`.

    Attributes:
        name: the key of the symbol in a point.
        values: a list of candidates, or a function ``point_so_far -> list``.

    >>> s = Symbol("tp", [1, 2, 4])
    >>> s.candidates({}), s.is_dependent
    ([1, 2, 4], False)
    >>> Symbol("r", lambda p: [p["tp"]]).candidates({"tp": 2})
    [2]
    """

    def __init__(self, name: str, values: Values) -> None:
        if not isinstance(name, str) or not name.isidentifier():
            raise TuneError(
                "a symbol name must be a Python identifier",
                primitive="Space.create_symbol",
                values={"name": name},
                fix="e.g. space.create_symbol('batch_size', [8, 16])",
            )
        self.name = name
        if callable(values):
            self.values: Values = values
        else:
            if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
                raise TuneError(
                    f"the candidates of symbol {name!r} must be a list or a function of the "
                    "point so far",
                    primitive="Space.create_symbol",
                    values={"symbol": name, "values": values},
                    fix=f"space.create_symbol({name!r}, [...]) or "
                    f"space.create_symbol({name!r}, lambda p: [...])",
                )
            self.values = self._checked(list(values), "Space.create_symbol")

    @property
    def is_dependent(self) -> bool:
        """Whether the candidates are computed from the symbols fixed before."""
        return callable(self.values)

    def _checked(self, values: list[Any], where: str) -> list[Any]:
        if not values:
            raise TuneError(
                f"symbol {self.name!r} has no candidate values",
                primitive=where,
                values={"symbol": self.name},
                fix=f"give at least one value: space.create_symbol({self.name!r}, [value])",
            )
        out: list[Any] = []
        keys: set[str] = set()
        for value in values:
            _check_value(self.name, value, where)
            key = json.dumps(value)
            if key not in keys:  # duplicates would make two identical points
                keys.add(key)
                out.append(value)
        return out

    def candidates(self, point: Mapping[str, Any]) -> list[Any]:
        """The candidate values given the values of the symbols fixed before this one.

        Raises:
            TuneError: the function reads a symbol that is not fixed yet, raises, or
                returns no values.
        """
        if not callable(self.values):
            return list(self.values)
        try:
            values = self.values(dict(point))
        except KeyError as exc:
            raise TuneError(
                f"the candidates of symbol {self.name!r} read {exc.args[0]!r}, which is not "
                "fixed before it",
                primitive="Space.enumerate",
                values={"symbol": self.name, "fixed": sorted(point)},
                fix=f"create symbol {exc.args[0]!r} before {self.name!r}",
            ) from None
        except Exception as exc:
            raise TuneError(
                f"the candidate function of symbol {self.name!r} raised "
                f"{type(exc).__name__}: {exc}",
                primitive="Space.enumerate",
                values={"symbol": self.name, "point": dict(point)},
                fix="make the function return a list for every combination of earlier values",
            ) from exc
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise TuneError(
                f"the candidate function of symbol {self.name!r} returned a "
                f"{type(values).__name__}, not a list",
                primitive="Space.enumerate",
                values={"symbol": self.name, "point": dict(point), "returned": values},
                fix="return a list of values, e.g. lambda p: [0.5, 1.0]",
            )
        return self._checked(list(values), "Space.enumerate")

    def __repr__(self) -> str:
        shown = "<function>" if callable(self.values) else repr(self.values)
        return f"Symbol({self.name!r}, {shown})"


class Space:
    """An ordered set of symbols and constraints; see the module docstring."""

    def __init__(self) -> None:
        self.symbols: dict[str, Symbol] = {}
        self.constraints: list[Callable[[Mapping[str, Any]], bool]] = []

    def create_symbol(self, name: str, values: Values) -> Symbol:
        """Add a symbol after the existing ones and return it.

        Args:
            name: its key in a point; must be new.
            values: a list of candidates, or ``fn(point_so_far) -> list``; the function may
                read every symbol created before this one.

        Raises:
            TuneError: a name used twice, no values, or values that are not JSON scalars.
        """
        if name in self.symbols:
            raise TuneError(
                f"symbol {name!r} is defined twice",
                primitive="Space.create_symbol",
                values={"name": name, "symbols": list(self.symbols)},
                fix="give the second symbol another name, or make its values depend on the "
                f"first: space.create_symbol('other', lambda p: [...p[{name!r}]...])",
            )
        symbol = Symbol(name, values)
        self.symbols[name] = symbol
        return symbol

    def add_constraint(self, fn: Callable[[Mapping[str, Any]], bool]) -> None:
        """Keep only the complete points for which ``fn(point)`` is true.

        Raises:
            TuneError: ``fn`` is not callable.
        """
        if not callable(fn):
            raise TuneError(
                "a constraint must be a function of a point that returns a bool",
                primitive="Space.add_constraint",
                values={"constraint": fn},
                fix="space.add_constraint(lambda p: p['batch_size'] % p['tp'] == 0)",
            )
        self.constraints.append(fn)

    def _keep(self, point: Point) -> bool:
        for number, fn in enumerate(self.constraints):
            try:
                ok = fn(point)
            except Exception as exc:
                raise TuneError(
                    f"constraint {number} raised {type(exc).__name__}: {exc}",
                    primitive="Space.add_constraint",
                    values={"constraint": number, "point": point},
                    fix="read only the symbols of the space, e.g. p['batch_size']",
                ) from exc
            if not ok:
                return False
        return True

    def enumerate(self) -> Iterator[Point]:
        """Every point (a new dict each), depth-first in creation order.

        Raises:
            TuneError: the space has no symbols, or a candidate function misbehaves.
        """
        if not self.symbols:
            raise TuneError(
                "the space has no symbols",
                primitive="Space.enumerate",
                fix="space.create_symbol('batch_size', [8, 16, 32])",
            )
        symbols = list(self.symbols.values())

        def walk(depth: int, point: Point) -> Iterator[Point]:
            if depth == len(symbols):
                if self._keep(point):
                    yield dict(point)
                return
            symbol = symbols[depth]
            for value in symbol.candidates(point):
                point[symbol.name] = value
                yield from walk(depth + 1, point)
                del point[symbol.name]

        yield from walk(0, {})

    def count(self) -> int:
        """The number of points :meth:`enumerate` yields."""
        return sum(1 for _ in self.enumerate())

    def contains(self, point: Mapping[str, Any]) -> bool:
        """Whether ``point`` is one of the points of the space.

        >>> space = Space(); _ = space.create_symbol("a", [1, 2])
        >>> space.contains({"a": 2}), space.contains({"a": 3}), space.contains({"b": 1})
        (True, False, False)
        """
        if set(point) != set(self.symbols):
            return False
        so_far: Point = {}
        for symbol in self.symbols.values():
            value = point[symbol.name]
            if not any(_same(value, c) for c in symbol.candidates(so_far)):
                return False
            so_far[symbol.name] = value
        return self._keep(so_far)

    def __repr__(self) -> str:
        inner = ", ".join(repr(s) for s in self.symbols.values())
        return f"Space([{inner}], constraints={len(self.constraints)})"


def _same(a: Any, b: Any) -> bool:
    return json.dumps(a) == json.dumps(b)
