"""Placeholder: being written."""
import contextlib


def build(sch, target=None, init_weights=False, param_init_fn=None, **kw):
    return sch.mod, None


@contextlib.contextmanager
def init_empty_weights():
    yield
