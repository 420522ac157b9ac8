"""Debug mode: debugpy in every worker, rank-aware breakpoints, live worker state, stacks.

`breakpoint` and `BreakpointSpec` are loaded on first use: the CLI imports this package's light modules
(state files) while parsing, and breakpoints.py brings torch (the model's hooks) with it."""

__all__ = ["breakpoint", "BreakpointSpec"]


def __getattr__(name: str):
    if name in __all__:
        from devharness.debug import breakpoints
        return getattr(breakpoints, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
