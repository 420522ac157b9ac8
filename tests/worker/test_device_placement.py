"""Every tensor the engine makes lives on the configured device, shown on a machine without a GPU.

torch's default device is set to `meta` while an engine configured for `cpu` is built and runs: a tensor
made without an explicit device (`torch.tensor(ids)` where `torch.tensor(ids, device=...)` was meant)
lands on `meta`, and a guard that sees every torch call names the call and the line that made it. On a
GPU the same slip would put a tensor on the CPU beside CUDA ones.

tests/gpu/test_engine_cuda.py's own look (stand-ins around ModelRunner.prepare_inputs and the runner's `sample`)
runs here too, on the CPU: the engine calls its stand-ins as it calls what they stand for, so that a change of
those calls fails here and not first on a GPU machine.
"""
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from devharness import LLM, SamplingParams
from devharness.protocol.messages import NewRequest, SchedulerOutput
from devharness.worker.model_runner import ModelRunner
from tests.gpu.cuda import assert_tensors_live_on

CONFIGURED = torch.device("cpu")
ELSEWHERE = "meta"   # torch's default device during the run: where a tensor without a device goes

# Token ids (so that block boundaries are known): B shares A's first two blocks (prefix cache), and a
# 32-token step budget splits A's 40-token prompt into chunks, so prefill chunks attend to cached context.
PROMPT_A = [(7 * i) % 250 + 1 for i in range(40)]
PROMPT_B = PROMPT_A[:32] + [3, 1, 4, 1, 5]
PROMPTS = [{"prompt_token_ids": PROMPT_A}, {"prompt_token_ids": PROMPT_B}, {"prompt_token_ids": [9, 8, 7]}]
PARAMS = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2),                 # greedy
          SamplingParams(max_tokens=6, temperature=0.8, top_k=20, top_p=0.9, seed=7, ignore_eos=True,
                         logprobs=0),                                                                   # filtered
          SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)]                      # plain


class StrayTensor(AssertionError):
    pass


class DeviceGuard(TorchFunctionMode):
    """Records each torch call that takes or returns a tensor off `device`, with the devharness line that made it."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device, self.calls, self.strays = device, 0, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.calls += 1
        try:
            out = func(*args, **kwargs)
        except Exception:
            self._check(func, (args, kwargs))
            raise
        self._check(func, (args, kwargs, out))
        return out

    def _check(self, func, values) -> None:
        tensors = [t for t in tree_flatten(values)[0] if isinstance(t, torch.Tensor)]
        off = {str(t.device) for t in tensors if t.device != self.device}
        if off and len(self.strays) < 5:
            ours = [f for f in traceback.extract_stack() if "/devharness/" in f.filename]
            where = f"{ours[-1].filename.split('/devharness/')[-1]}:{ours[-1].lineno} {ours[-1].line}" if ours else "?"
            self.strays.append(f"{getattr(func, '__name__', func)} on {sorted(off)} at {where}")


def guarded(run):
    """run() with torch's default device elsewhere and every call checked; (its result, the guard). A stray
    tensor fails here by the line that made it, before whatever it broke downstream."""
    guard = DeviceGuard(CONFIGURED)
    try:
        with torch.device(ELSEWHERE), guard:
            return run(), guard
    finally:
        if guard.strays:
            raise StrayTensor("tensors made off the configured device:\n" + "\n".join(guard.strays))


def _outputs(outs):
    return [(o.outputs[0].token_ids, [(lp.token_logprob, lp.top_token_ids) if lp else None
                                      for lp in o.outputs[0].logprobs or []]) for o in outs]


@pytest.fixture(scope="module")
def built():
    """The engine, built under the guard (weights, RoPE tables, KV cache) and returned with it."""
    llm, guard = guarded(lambda: LLM(model="tiny-llama", distributed_executor_backend="uni", threads_per_worker=1,
                                     num_kv_blocks=32, max_num_batched_tokens=32, seed=0))
    llm.engine.core.executor.worker.runner.digest_logits = True   # the digest's tensors too
    yield llm, guard
    llm.shutdown()


def test_building_the_engine_keeps_every_tensor_on_the_device(built):
    _, guard = built
    assert guard.calls > 0   # the guard did see the build (same thread); guarded() checked it made no stray


def test_a_step_keeps_every_tensor_on_the_device(built):
    llm, _ = built
    reference = _outputs(llm.generate(PROMPTS, PARAMS))
    outs, guard = guarded(lambda: llm.generate(PROMPTS, PARAMS))
    assert guard.calls > 1000   # prepare, forward, attention, sampling of every step went through it
    assert _outputs(outs) == reference


def test_a_tensor_made_without_its_device_is_named(built, monkeypatch):
    """The planted slip: step inputs built the way they once were, on torch's default device."""
    runner = built[0].engine.core.executor.worker.runner
    monkeypatch.setattr(ModelRunner, "_to_device", lambda self, values: torch.tensor(values, dtype=torch.long))
    # A prefill chunk over 16 cached tokens, as the scheduler would send it (read only: nothing runs).
    so = SchedulerOutput(1, [NewRequest("planted", list(range(1, 21)), 20, [0, 1], 16, SamplingParams(), 0)], [],
                         {"planted": 4}, [])
    runner.update_states(so)
    try:
        with pytest.raises(StrayTensor) as failed:
            guarded(lambda: runner.prepare_inputs(so))
    finally:
        runner.update_states(SchedulerOutput(2, [], [], {}, ["planted"]))
    assert "tensor on ['meta'] at worker/model_runner.py" in str(failed.value), failed.value


# -- tests/gpu/test_engine_cuda.py's look, on the CPU --------------------------------------------------------

def test_the_gpu_checks_look_passes_on_the_cpu(built, monkeypatch):
    assert_tensors_live_on(built[0], CONFIGURED, monkeypatch)


def test_the_gpu_checks_look_names_a_tensor_elsewhere(built, monkeypatch):
    with pytest.raises(AssertionError) as failed:
        assert_tensors_live_on(built[0], ELSEWHERE, monkeypatch)
    assert "layer 0 k_cache" in str(failed.value) and "sample 1 tokens" in str(failed.value), failed.value


def test_a_stand_in_the_code_calls_otherwise_fails_the_step(built, monkeypatch):
    """A stand-in of sample's old shape (three arguments, before it took the raw logits): the step's sampling
    fails, named, where it ran unseen on the CPU before."""
    from devharness.model import sampler
    real = sampler.sample

    def checked_sample(logits, batch, argmax):
        return real(logits, batch, argmax)

    monkeypatch.setattr("devharness.worker.model_runner.sample", checked_sample)
    with pytest.raises(Exception) as failed:
        built[0].generate(PROMPTS[2:], PARAMS[2:])
    assert "checked_sample() takes 3 positional arguments but 4 were given" in str(failed.value), failed.value
