"""`devharness bench ...`: each benchmark measures its cases side by side in one run and prints ratios."""
from __future__ import annotations


def register_benchmarks(sub, add_engine_args) -> None:
    from devharness.bench import throughput
    throughput.register(sub, add_engine_args)
    from devharness.bench import debug_overhead, executor
    executor.register(sub, add_engine_args)
    debug_overhead.register(sub, add_engine_args)
