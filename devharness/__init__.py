"""devharness: a debuggable LLM inference engine and developer harness.

The Python API is resolved on first use, so `import devharness.tui.app` (a laptop watching a server)
loads neither torch nor Ray."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from devharness.engine.args import EngineArgs
    from devharness.engine.llm import LLM
    from devharness.engine.output import CompletionOutput, RequestOutput
    from devharness.sampling_params import SamplingParams

_WHERE = {"LLM": "devharness.engine.llm", "SamplingParams": "devharness.sampling_params",
          "RequestOutput": "devharness.engine.output", "CompletionOutput": "devharness.engine.output",
          "EngineArgs": "devharness.engine.args"}
__all__ = list(_WHERE)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'devharness' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
