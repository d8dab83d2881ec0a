"""Placeholder: being written."""


def render_tree(sch):
    return repr(sch)
