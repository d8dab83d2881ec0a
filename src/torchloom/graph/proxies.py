"""Value-carrying proxies: ``fx`` proxies that may carry the example value of what they
stand for, so ``len()``, ``int()``, ``in`` and attribute reads work while tracing."""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

import torch.fx as fx

from .guards import _guard_is_none, _user_frame

if TYPE_CHECKING:
    from .tracer import _Tracer
    _ProxyBase = fx.Proxy  # for the checker the mixin is a proxy (it is only mixed into ones)
else:
    _ProxyBase = object


_NO_VALUE = object()  # the value of a proxy is unknown (tracer="fx")


class _ValueMixin(_ProxyBase):
    """What a proxy that may carry an example value adds to ``fx.Proxy``."""

    tracer: _Tracer

    def __getattr__(self, k: str) -> Any:
        if k.startswith("__") or k in ("_node", "root", "attr", "tracer", "node"):
            raise AttributeError(k)
        tracer = self.tracer
        value = tracer.value_of(self)
        if value is _NO_VALUE:
            if k.startswith("_"):
                raise AttributeError(k)
            return _ValueAttribute(self, k)
        if not hasattr(value, k):
            raise AttributeError(k)
        if getattr(value, k) is None:  # e.g. an output field that is None: specialise
            node = tracer.create_proxy("call_function", getattr, (self, k), {}).node
            tracer.create_node("call_function", _guard_is_none,
                               (node, f"{tracer.where}|{_user_frame()}"), {})
            return None
        return _ValueAttribute(self, k)

    def __len__(self) -> int:
        return self.tracer.specialise_len(self)

    def __index__(self) -> int:
        return self.tracer.specialise_number(self, operator.index)

    def __int__(self) -> int:
        return self.tracer.specialise_number(self, int)

    def __float__(self) -> float:
        return self.tracer.specialise_number(self, float)

    def __contains__(self, item: Any) -> bool:
        return any(item is x or item == x for x in self.tracer.iter(self))


class _ValueProxy(_ValueMixin, fx.Proxy):
    pass


class _ValueAttribute(_ValueMixin, fx.proxy.Attribute):
    pass
