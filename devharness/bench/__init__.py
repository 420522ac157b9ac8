"""`devharness bench ...`: each benchmark measures its cases side by side in one run and prints ratios."""
from __future__ import annotations


def register_benchmarks(sub) -> None:
    from devharness.bench import (debug_overhead, executor, kernels, load, restart, single_stream, throughput,
                                  timeline)
    throughput.register(sub)
    executor.register(sub)
    debug_overhead.register(sub)
    restart.register(sub)
    load.register(sub)
    kernels.register(sub)
    timeline.register(sub)
    single_stream.register(sub)
