"""Reading the script a recipe prints, without running it.

``str(recipe)`` writes ``import`` lines, then ``sch = torchloom.create_schedule(model)``,
then one call ``sch['path'].primitive(...)`` per line. :func:`parse_script` parses such a
text with :mod:`ast` and accepts nothing else: arguments are literals (numbers, strings,
lists, tuples, dicts), ``torch`` dtypes, or dotted names of imported modules' functions
and classes, resolved as references are (:mod:`torchloom.core.refs`); every call is
checked like a JSON line (:mod:`torchloom.core.recipe_values`). It returns the calls;
:meth:`torchloom.core.recipe_data.Recipe.from_script` makes the recipe of them.

>>> parse_script("import torchloom\\n\\nsch = torchloom.create_schedule(model)\\n"
...              "sch['0'].checkpoint(ratio=0.5)", None, False)
[('checkpoint', '0', (), {'ratio': 0.5})]
>>> parse_script("import os\\nos.system('true')", None, False)
Traceback (most recent call last):
...
torchloom.core.errors.RecipeError: Recipe.from_script(...): script line 2: not a recipe statement: "os.system('true')"
    values: line=2
    fix: a recipe script is import lines, 'sch = torchloom.create_schedule(model)', then sch['path'].primitive(...) calls
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from typing import Any, Callable, cast

from .errors import RecipeError
from .recipe_values import _DTYPES, MAX_DEPTH, _check_fields, _check_places
from .refs import Refused, check_trusted, resolve_untrusted, short_repr

__all__ = ["Call", "parse_script"]

#: One call of a script: primitive name, schedule path, arguments and keywords.
Call = tuple[str, str, tuple[Any, ...], dict[str, Any]]


def _script_error(line: int, problem: str, values: dict[str, Any] | None = None,
                  fix: str | None = None) -> RecipeError:
    return RecipeError(f"script line {line}: {problem}", primitive="Recipe.from_script",
                       values={"line": line, **(values or {})},
                       fix=fix or "pass the script that print(sch.recipe) writes")


def _dotted_name(node: ast.expr) -> str | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def _literal(node: ast.expr, imports: set[str], resolve: Callable[[str], Any],
             depth: int = 0) -> Any:
    """The value of an argument expression of a printed recipe; raises ``Refused``."""
    if depth > MAX_DEPTH:
        raise Refused(f"an argument is nested deeper than {MAX_DEPTH} levels",
                       {"max_depth": MAX_DEPTH}, "flatten the argument")
    if isinstance(node, ast.Constant) and (node.value is None
                                           or type(node.value) in (bool, int, float, str)):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) and \
            isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float):
        value = cast(float, node.operand.value)  # an int or a float (checked above)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.List):
        return [_literal(e, imports, resolve, depth + 1) for e in node.elts]
    if isinstance(node, ast.Tuple):
        return tuple(_literal(e, imports, resolve, depth + 1) for e in node.elts)
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) and type(k.value) is str
                                          for k in node.keys):
        return {k.value: _literal(v, imports, resolve, depth + 1)  # type: ignore[union-attr]
                for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
            node.func.id == "float" and not node.keywords and len(node.args) == 1 and \
            isinstance(node.args[0], ast.Constant) and \
            node.args[0].value in ("nan", "inf", "-inf"):
        return float(node.args[0].value)
    dotted = _dotted_name(node)
    if dotted is not None and "." in dotted:
        head, _, attr = dotted.partition(".")
        if head == "torch" and attr in _DTYPES and "torch" in imports:
            return _DTYPES[attr]
        parts = dotted.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            module = ".".join(parts[:cut])
            if module in imports:
                return resolve(f"{module}:{'.'.join(parts[cut:])}")
        raise Refused(f"{dotted!r} is not in a module the script imports",
                       {"name": dotted}, "import its module at the top of the script")
    raise Refused(f"{short_repr(ast.unparse(node))} is not a recipe value",
                   {"expression": short_repr(ast.unparse(node))},
                   "write arguments as literals, torch dtypes or imported names")


def parse_script(text: str, trusted_refs: Mapping[str, Any] | None,
                 trust_code: bool) -> list[Call]:
    """The calls of a printed recipe, each checked (see the module docstring); raises
    :class:`RecipeError` naming the script line."""
    check_trusted(trusted_refs, "Recipe.from_script")
    if not isinstance(text, str):
        raise _script_error(0, f"a script is text, not a {type(text).__name__}")
    try:
        tree = ast.parse(text, mode="exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise _script_error(getattr(exc, "lineno", None) or 0,
                            f"not Python: {type(exc).__name__}: {exc}") from None

    def resolve(ref: str) -> Any:
        return resolve_untrusted(ref, trusted_refs, trust_code)

    imports: set[str] = set()
    created = False
    calls: list[Call] = []
    for stmt in tree.body:
        line = stmt.lineno
        if not created and isinstance(stmt, ast.Import) and \
                all(alias.asname is None for alias in stmt.names):
            imports.update(alias.name for alias in stmt.names)
            continue
        if not created and isinstance(stmt, ast.Assign) and \
                ast.unparse(stmt) == "sch = torchloom.create_schedule(model)" and \
                "torchloom" in imports:
            created = True
            continue
        call = stmt.value if isinstance(stmt, ast.Expr) else None
        target = call.func if isinstance(call, ast.Call) else None
        node = target.value if isinstance(target, ast.Attribute) else None
        if not (created and isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name)
                and node.value.id == "sch" and isinstance(node.slice, ast.Constant)
                and isinstance(node.slice.value, str)):
            raise _script_error(line, "not a recipe statement: "
                                f"{short_repr(ast.unparse(stmt))}",
                                fix="a recipe script is import lines, "
                                "'sch = torchloom.create_schedule(model)', then "
                                "sch['path'].primitive(...) calls")
        assert isinstance(call, ast.Call) and isinstance(target, ast.Attribute)
        try:
            if any(isinstance(a, ast.Starred) for a in call.args) or \
                    any(k.arg is None for k in call.keywords):
                raise Refused("*args and **kwargs are not recipe arguments", {},
                               "write each argument out")
            args = [_literal(a, imports, resolve) for a in call.args]
            kwargs = {cast(str, k.arg): _literal(k.value, imports, resolve) for k in call.keywords}
            _check_fields(target.attr, node.slice.value, args, kwargs)
            _check_places(target.attr, args, kwargs, trusted_refs, trust_code)
        except Refused as exc:
            raise _script_error(line, exc.problem, exc.values, exc.fix) from None
        calls.append((target.attr, node.slice.value, tuple(args), kwargs))
    return calls
