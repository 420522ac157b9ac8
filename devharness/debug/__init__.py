"""Debug mode: debugpy in every worker, rank-aware breakpoints, live worker state, stacks."""
from devharness.debug.breakpoints import BreakpointSpec, breakpoint

__all__ = ["breakpoint", "BreakpointSpec"]
