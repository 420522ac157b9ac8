"""devharness: a debuggable LLM inference engine and developer harness."""
from devharness.engine.llm import LLM
from devharness.engine.output import CompletionOutput, RequestOutput
from devharness.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
