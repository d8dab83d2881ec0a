"""Render a schedule as a tree, with the primitives applied at each node.

:func:`render_tree` (what ``print(sch)`` shows) draws one line per schedule node: its
name, its module class and the shapes of the module's own parameters. Below a node come
the primitives that were applied to it, marked ``◆``, read from the root's recipe (not
from any other state), in recipe order. A run of identical items of a ``ModuleList`` or
``Sequential`` (same class, same sub-tree, same shapes, same primitives) is drawn once,
as ``h.0 .. h.11: GPT2Block x12``; an item with a different primitive breaks the run.
A sharded parameter shows its local and full size along the sharded axis
(``weight[32, 48 of 96]``). A recipe entry whose path is no longer in the tree (a
sub-module that a later ``replace`` removed) is shown at the nearest node that still
exists, with its full call.

>>> import torch, torchloom as tl
>>> from torch import nn
>>> model = nn.Sequential(nn.Embedding(10, 4),
...                       nn.ModuleList(nn.Linear(4, 4) for _ in range(4)))
>>> sch = tl.create_schedule(model)
>>> sch["1.3"].annotate("weight", "tied", False)
>>> print(render_tree(sch))
Sequential (120 params)
├── 0: Embedding  weight[10, 4]
└── 1: ModuleList
    ├── 1.0 .. 1.2: Linear x3  weight[4, 4] bias[4]
    └── 1.3: Linear  weight[4, 4] bias[4]
        └── ◆ .annotate('weight', 'tied', False)

:func:`rich_tree` gives the same content as a :class:`rich.tree.Tree` for terminals.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .meta import shard_spec

if TYPE_CHECKING:
    import rich.tree
    import torch

    from .recipe_data import RecipeEntry
    from .schedule import Schedule

__all__ = ["render_tree", "rich_tree"]

PRIMITIVE_MARK = "◆"
_MAX_PARAMS_SHOWN = 4
_MIN_RUN = 2


@dataclass
class _Line:
    """One drawn node: ``name: cls xcount  shapes``, its primitives, its children."""

    name: str
    cls: str
    shapes: str
    primitives: list[str] = field(default_factory=list)
    children: list[_Line] = field(default_factory=list)
    count: int = 1

    def key(self) -> tuple[Any, ...]:
        """Everything but the name: two items with equal keys are drawn once."""
        return (self.cls, self.shapes, tuple(self.primitives), self.count,
                tuple((c.name, c.key()) for c in self.children))

    def head(self) -> str:
        text = f"{self.name}: {self.cls}" if self.name else self.cls
        if self.count > 1:
            text += f" x{self.count}"
        return f"{text}  {self.shapes}" if self.shapes else text


def _shape_text(tensor: torch.Tensor) -> str:
    dims = [str(d) for d in tensor.shape]
    spec = shard_spec(tensor)
    if spec is not None and 0 <= spec.axis < len(dims):
        dims[spec.axis] = f"{dims[spec.axis]} of {spec.full_shape[spec.axis]}"
    return "[" + ", ".join(dims) + "]"


def _own_shapes(sch: Schedule) -> str:
    params = [(n, p) for n, p in sch.mod._parameters.items() if p is not None]
    shown = [f"{n}{_shape_text(p)}" for n, p in params[:_MAX_PARAMS_SHOWN]]
    if len(params) > _MAX_PARAMS_SHOWN:
        shown.append(f"+{len(params) - _MAX_PARAMS_SHOWN} more")
    return " ".join(shown)


def _short_count(n: int) -> str:
    for limit, suffix in ((10**9, "B"), (10**6, "M"), (10**3, "K")):
        if n >= limit:
            return f"{n / limit:.1f}{suffix}"
    return str(n)


def _call_at_node(entry: RecipeEntry) -> str:
    """``sch['a.b'].shard('weight', 0)`` -> ``.shard('weight', 0)``."""
    text = entry.call_text_safe()
    prefix = f"sch[{entry.path!r}]"
    return text[len(prefix):] if text.startswith(prefix) else text


def _is_item(name: str) -> bool:
    return name.isdigit()


def _primitives_by_node(sch: Schedule) -> dict[str, list[str]]:
    """The recipe entries at or below ``sch``, as display text keyed by an existing path."""
    existing = {node.path for _, node in sch.named_schedules()}
    found: dict[str, list[str]] = defaultdict(list)
    base = sch.path
    for entry in sch.recipe:
        inside = base == "" or entry.path == base or entry.path.startswith(base + ".")
        if not inside:
            continue
        if entry.path in existing:
            found[entry.path].append(_call_at_node(entry))
            continue
        # The node was removed (e.g. its parent was replaced): show it at the deepest
        # ancestor that still exists, with the whole call.
        ancestor = entry.path
        while ancestor not in existing:
            ancestor = ancestor.rpartition(".")[0]
            if ancestor == "" and "" not in existing:
                ancestor = base
                break
        found[ancestor].append(f"{entry.call_text_safe()}  (path no longer in the tree)")
    return found


def _build(node: Schedule, name: str, primitives: dict[str, list[str]]) -> _Line:
    line = _Line(name, type(node.mod).__name__, _own_shapes(node),
                 list(primitives.get(node.path, [])))
    children = [
        (child_name, _build(child, _item_name(node, child_name), primitives))
        for child_name, child in node.child.items()
    ]
    line.children = _collapse(node, children)
    return line


def _item_name(parent: Schedule, child_name: str) -> str:
    if _is_item(child_name) and parent.name:
        return f"{parent.name}.{child_name}"
    return child_name


def _collapse(parent: Schedule, children: list[tuple[str, _Line]]) -> list[_Line]:
    """Merge runs of equal consecutive numbered items into one line."""
    out: list[_Line] = []
    i = 0
    while i < len(children):
        name, line = children[i]
        j = i + 1
        if _is_item(name):
            while (j < len(children) and _is_item(children[j][0])
                   and children[j][1].key() == line.key()):
                j += 1
        if j - i >= _MIN_RUN:
            last = children[j - 1][1].name
            out.append(_Line(f"{line.name} .. {last}", line.cls, line.shapes, line.primitives,
                             line.children, count=j - i))
        else:
            out.append(line)
        i = j
    return out


def _root_line(sch: Schedule) -> _Line:
    primitives = _primitives_by_node(sch)
    line = _build(sch, sch.path, primitives)
    if sch.parent is None:
        total = sum(p.numel() for p in sch.mod.parameters())
        line.cls = f"{line.cls} ({_short_count(total)} params)"
    return line


def _draw(line: _Line, prefix: str, out: list[str]) -> None:
    items: list[str | _Line] = [f"{PRIMITIVE_MARK} {p}" for p in line.primitives]
    items += line.children
    for index, item in enumerate(items):
        last = index == len(items) - 1
        branch, extend = ("└── ", "    ") if last else ("├── ", "│   ")
        if isinstance(item, str):
            out.append(prefix + branch + item)
        else:
            out.append(prefix + branch + item.head())
            _draw(item, prefix + extend, out)


def render_tree(sch: Schedule) -> str:
    """The schedule tree below ``sch`` as plain text, with the primitives applied at each
    node (from the recipe) and runs of identical ``ModuleList`` items collapsed."""
    root = _root_line(sch)
    out = [root.head()]
    _draw(root, "", out)
    return "\n".join(out)


def rich_tree(sch: Schedule) -> rich.tree.Tree:
    """The same tree as :func:`render_tree`, as a styled :class:`rich.tree.Tree`."""
    from rich.markup import escape
    from rich.tree import Tree

    def label(line: _Line) -> str:
        text = f"[bold]{escape(line.name)}[/]: " if line.name else ""
        text += f"[cyan]{escape(line.cls)}[/]"
        if line.count > 1:
            text += f" [yellow]x{line.count}[/]"
        if line.shapes:
            text += f"  [dim]{escape(line.shapes)}[/]"
        return text

    def fill(tree: Tree, line: _Line) -> None:
        for primitive in line.primitives:
            tree.add(f"[bold magenta]{PRIMITIVE_MARK} {escape(primitive)}[/]")
        for child in line.children:
            fill(tree.add(label(child)), child)

    root = _root_line(sch)
    tree = Tree(label(root))
    fill(tree, root)
    return tree
