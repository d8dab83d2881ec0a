"""``compile(backend="inductor", mode=None, dynamic=None, fullgraph=False)``: run a
module's forward through ``torch.compile``, in place.

The module keeps its place, class, children, Parameter objects, ``state_dict()`` keys and
hooks: only its ``forward`` is compiled (on its first call), so ``print(model)``, paths
and checkpoints look as before. This is how a transformer is usually compiled for
training (one layer at a time): every layer of a stack has the same code, so the layers
share one compiled graph, and the code between layers (embeddings, loss) stays eager.

Composition with the other primitives that install an instance ``forward``
(``checkpoint``, ``fork_rng``): the compiled function always sits *innermost*, around the
class ``forward``, whatever the order the primitives were applied in. So a checkpointed
layer recomputes by running the compiled code again (the global random state is restored
for it, so the dropout masks are drawn again identically), and ``fork_rng`` switches the
random stream outside the compiled code.

Numerics: the compiled code computes the same function with fused loops, so results
differ from eager in the last bits (fp32: about 1e-6 relative). With dropout in training,
inductor draws its masks with its own generator (seeded from the global one), so the
masks are not the ones eager would draw: the same distribution, not the same bits. Pass
``backend="aot_eager"`` (or ``torch._inductor.config.fallback_random = True``) to keep
eager's random stream.

Preconditions:
    * the module has a ``forward`` of its own (an ``nn.ModuleList`` has none: use a
      wildcard path such as ``sch['h.*'].compile()``) and was not compiled already;
    * ``backend`` is a ``torch.compile`` backend name (``torch.compiler.list_backends()``,
      plus ``"eager"`` and ``"aot_eager"``) or a backend callable; ``mode`` is None or one
      of ``torch.compile``'s modes; ``dynamic`` is None or a bool; ``fullgraph`` a bool.

Before / after (``backend="eager"`` compiles nothing but the capture, so the example runs
quickly; the default is inductor):

>>> import torch, torchloom as tl
>>> from torch import nn
>>> model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 2))
>>> x = torch.randn(3, 4)
>>> expected = model(x)
>>> sch = tl.create_schedule(model)
>>> sch.compile(backend="eager")
>>> model.forward
<compiled forward of Sequential at '' (backend='eager')>
>>> torch.equal(model(x), expected), list(model.state_dict())[:2]
(True, ['0.weight', '0.bias'])
>>> sch.recipe[-1].call_text()
"sch[''].compile(backend='eager')"
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from ..core.errors import CompileError
from ..core.marks import COMPILED, has_mark, set_mark
from ..core.registry import primitive
from ._common import ForwardWrapper

if TYPE_CHECKING:
    from ..core.schedule import Schedule

NAME = "compile"
MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

__all__ = ["MODES", "NAME", "apply", "backends"]


def backends() -> list[str]:
    """The backend names ``compile`` accepts (registered ones, debug ones included)."""
    import torch._dynamo  # noqa: F401  (registers the backends)

    return sorted(set(torch.compiler.list_backends(exclude_tags=())) | {"eager", "aot_eager"})


class _CompiledForward(ForwardWrapper):
    """The innermost instance ``forward`` installed by ``compile``: the class ``forward``
    of the module under ``torch.compile``, created on the first call."""

    def __init__(self, module: nn.Module, path: str, backend: str | Callable[..., Any],
                 options: dict[str, Any]) -> None:
        super().__init__(module, None, path)
        self.backend = backend
        self.options = options
        self._compiled: Callable[..., Any] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._compiled is None:
            # The class's forward, with the module as its first argument: dynamo caches
            # compiled code per code object, so every layer of one class shares it (and
            # the recompile limit is per class, not shared by all compiled modules).
            self._compiled = torch.compile(type(self.module).forward, backend=self.backend,
                                           **self.options)
        return self._compiled(self.module, *args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_compiled"] = None  # a copy compiles again on its first call
        return state

    def __repr__(self) -> str:
        backend = self.backend if isinstance(self.backend, str) else \
            getattr(self.backend, "__name__", type(self.backend).__name__)
        return (f"<compiled forward of {type(self.module).__name__} at {self.path!r} "
                f"(backend={backend!r})>")


def _check(sch: Schedule, backend: Any, mode: Any, dynamic: Any, fullgraph: Any) -> None:
    mod = sch.mod
    values = {"module": type(mod).__name__}
    if has_mark(mod, COMPILED):
        raise CompileError(
            "this module is compiled already", path=sch.path, primitive=NAME, values=values,
            fix=f"compile it once: remove the second sch[{sch.path!r}].compile()")
    if type(mod).forward is nn.Module.forward and "forward" not in mod.__dict__:
        raise CompileError(
            f"a {type(mod).__name__} has no forward of its own; its items are called one "
            "by one", path=sch.path, primitive=NAME, values=values,
            fix=f"compile the items: sch[{(sch.path + '.*').lstrip('.')!r}].compile()")
    if isinstance(backend, str):
        known = backends()
        if backend not in known:
            raise CompileError(
                f"torch.compile has no backend {backend!r}", path=sch.path, primitive=NAME,
                values={"backend": backend, "backends": known},
                fix="backend='inductor' (the default), 'aot_eager' or 'eager'")
    elif not callable(backend):
        raise CompileError(
            "backend must be a backend name or a backend callable", path=sch.path,
            primitive=NAME, values={"backend": repr(backend)}, fix="backend='inductor'")
    if mode not in MODES:
        raise CompileError(
            f"torch.compile has no mode {mode!r}", path=sch.path, primitive=NAME,
            values={"mode": mode, "modes": list(MODES)}, fix="mode=None (the default)")
    if dynamic not in (None, True, False) or not isinstance(fullgraph, bool):
        raise CompileError(
            "dynamic must be None, True or False and fullgraph True or False",
            path=sch.path, primitive=NAME,
            values={"dynamic": repr(dynamic), "fullgraph": repr(fullgraph)},
            fix="compile(dynamic=None, fullgraph=False)")


@primitive(NAME, errors=(CompileError,))
def apply(sch: Schedule, backend: str | Callable[..., Any] = "inductor", *,
          mode: str | None = None, dynamic: bool | None = None,
          fullgraph: bool = False) -> None:
    """Compile ``sch.mod``'s forward in place (innermost of its forward wrappers)."""
    _check(sch, backend, mode, dynamic, fullgraph)
    mod = sch.mod
    options: dict[str, Any] = {"fullgraph": fullgraph}
    if mode is not None:
        options["mode"] = mode
    if dynamic is not None:
        options["dynamic"] = dynamic
    compiled = _CompiledForward(mod, sch.path, backend, options)
    outer = mod.__dict__.get("forward")
    if outer is None:
        mod.forward = compiled
    else:
        # Below checkpoint / fork_rng wrappers: find the one that calls the class forward.
        while isinstance(getattr(outer, "inner", None), ForwardWrapper):
            outer = outer.inner
        if not isinstance(outer, ForwardWrapper) or outer.inner is not None:
            raise CompileError(
                "the module's forward was replaced on the instance by something torchloom "
                "did not install, so the class forward is not what runs",
                path=sch.path, primitive=NAME, values={"forward": repr(outer)},
                fix="compile the module before replacing its forward, or compile its "
                "children")
        outer.inner = compiled
    set_mark(mod, COMPILED, True)
