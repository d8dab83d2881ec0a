"""The package's layers: every import inside ``torchloom`` points down (or stays in its
own package), and no two packages import each other.

The order, lowest first, is the one README "How the code is laid out" gives. An import
counts wherever it is written (module level, inside a function, under ``TYPE_CHECKING``):
a lazy import of a higher layer is still a dependency on it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import torchloom

PACKAGE = Path(torchloom.__file__).parent

#: Lowest first. ``torchloom`` itself (the facade ``__init__`` and ``__main__``) is above all.
LAYERS = ["core", "graph", "runtime", "primitives", "ops", "schedules", "parallel", "tools", "plan",
          "tune", "apps"]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every torchloom import in ``path``; ``from X import y``
    counts as ``X.y`` when that is a module, else as ``X``."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                is_module = (PACKAGE.parent / sub.replace(".", "/")).with_suffix(".py").exists() \
                    or (PACKAGE.parent / sub.replace(".", "/") / "__init__.py").exists()
                found.append((node.lineno, sub if is_module else module))
    return [(line, m) for line, m in found if m == "torchloom" or m.startswith("torchloom.")]


def _layer(module: str) -> str:
    """The package a module belongs to (``torchloom`` for the facade)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "torchloom"


def _rank(layer: str) -> int:
    return LAYERS.index(layer) if layer in LAYERS else len(LAYERS)


def _edges() -> list[tuple[str, int, str]]:
    """(importing file, line, imported module) for every torchloom import of the package."""
    return [(str(path.relative_to(PACKAGE.parent)), line, target)
            for path in sorted(PACKAGE.rglob("*.py"))
            for line, target in _imports(path)]


def test_every_module_lies_in_a_layer() -> None:
    loose = sorted(_module_name(p) for p in PACKAGE.glob("*.py")
                   if p.stem not in ("__init__", "__main__"))
    assert loose == [], f"modules outside the layer packages: {loose}"
    packages = sorted(p.name for p in PACKAGE.iterdir()
                      if (p / "__init__.py").exists())
    assert packages == sorted(LAYERS)


def test_imports_point_down() -> None:
    upward = [f"{file}:{line} imports {target} ({_layer(target)} is above "
              f"{_layer(_module_name(PACKAGE.parent / file))})"
              for file, line, target in _edges()
              if _rank(_layer(target)) > _rank(_layer(_module_name(PACKAGE.parent / file)))]
    assert upward == [], "\n".join(upward)


def test_no_cycle_between_packages() -> None:
    graph: dict[str, set[str]] = {}
    for file, _, target in _edges():
        here, there = _layer(_module_name(PACKAGE.parent / file)), _layer(target)
        if here != there:
            graph.setdefault(here, set()).add(there)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in graph.get(start, ()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    cycles = sorted(p for p in graph if reaches(p, p, {p}))
    assert cycles == [], f"packages in an import cycle: {cycles}"


def test_the_checker_sees_an_upward_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The test above can fail: a core module importing a primitive is reported."""
    fake = tmp_path / "torchloom"
    (fake / "core").mkdir(parents=True)
    (fake / "primitives").mkdir()
    for p in (fake / "__init__.py", fake / "core/__init__.py", fake / "primitives/__init__.py",
              fake / "primitives/shard.py"):
        p.write_text("")
    (fake / "core/schedule.py").write_text("def f():\n    from ..primitives import shard\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake, raising=False)
    monkeypatch.setitem(globals(), "PACKAGE", fake)
    with pytest.raises(AssertionError, match=r"core/schedule.py:2 imports "
                       r"torchloom.primitives.shard \(primitives is above core\)"):
        test_imports_point_down()
