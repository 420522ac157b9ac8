"""What the GPU checks share: skipping without CUDA, and a look at where an engine's tensors live. Importable
without CUDA: tests/worker/test_placement.py runs the look on the CPU, and tests/test_gpu_checks.py holds every
GPU check's imports, calls and stand-ins to the code they test, so that neither drifts unseen on a CPU machine."""
import pytest
import torch


def require_gpus(n: int) -> None:
    """Skip the calling module (a GPU check, `make gpu-check`) when torch sees fewer than `n` CUDA devices."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < n:
        pytest.skip(f"needs {n} CUDA device(s), torch {torch.__version__} sees {count}: a GPU check, run by "
                    "`make gpu-check` on a GPU machine", allow_module_level=True)


def step_tensors(inputs) -> dict[str, torch.Tensor]:
    """Every tensor of a StepInputs (model_runner.py), by name."""
    meta = inputs.meta
    found = {"input_ids": inputs.input_ids, "positions": inputs.positions,
             "sample_token_index": inputs.sample_token_index, "slot_mapping": meta.slot_mapping}
    for i, g in enumerate(meta.decode_groups):
        found[f"decode_groups[{i}].block_tables"] = g.block_tables
        found[f"decode_groups[{i}].context_lens"] = g.context_lens
    for i, c in enumerate(meta.prefills):
        found[f"prefills[{i}].block_ids"] = c.block_ids
    return found


def assert_tensors_live_on(llm, device, monkeypatch) -> None:
    """Every tensor of a uni engine's model and KV cache, each step's inputs and what the sampler takes and makes
    are on `device`, over steps that chunk prompts over cached blocks, decode, sample greedily and seeded, with
    logprobs and without. The stand-ins take what the code passes to ModelRunner.prepare_inputs and to the
    runner's `sample` (model/sampler.py), and pass it on whole."""
    from devharness import SamplingParams
    from devharness.model import sampler
    from devharness.worker.model_runner import ModelRunner
    from tests.helpers import as_inputs

    device = torch.device(device)
    runner = llm.engine.core.executor.worker.runner
    off = {name: t.device for name, t in [*runner.model.named_parameters(), *runner.model.named_buffers()]
           if t.device != device}
    off.update({f"layer {i} {kind}": t.device for i, a in enumerate(runner.model.attention_layers())
                for kind, t in (("k_cache", a.k_cache), ("v_cache", a.v_cache)) if t.device != device})
    prepare, sample = ModelRunner.prepare_inputs, sampler.sample
    seen = {"steps": 0, "sampled": 0}

    def checked_prepare(self, so):
        inputs = prepare(self, so)
        seen["steps"] += 1
        off.update({f"step {so.step} {name}": t.device for name, t in step_tensors(inputs).items()
                    if t.device != device})
        return inputs

    def checked_sample(logits, batch, argmax, raw_logits=None):
        tokens, logprobs = sample(logits, batch, argmax, raw_logits)
        seen["sampled"] += 1
        made = {"logits": logits, "raw_logits": raw_logits, "tokens": tokens, "logprobs": logprobs}
        off.update({f"sample {seen['sampled']} {name}": t.device for name, t in made.items()
                    if t is not None and t.device != device})
        return tokens, logprobs

    monkeypatch.setattr(ModelRunner, "prepare_inputs", checked_prepare)
    monkeypatch.setattr("devharness.worker.model_runner.sample", checked_sample)
    prompts = [list(range(1, 40)), list(range(1, 33)) + [7, 7], [5]]   # chunks over cached blocks, decodes
    params = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3),
              SamplingParams(max_tokens=8, temperature=0.7, top_k=20, top_p=0.9, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=1.0, seed=2, ignore_eos=True, logprobs=0)]
    llm.generate(as_inputs(prompts), params)
    assert seen["steps"] >= 8 and seen["sampled"] >= 8, seen
    assert off == {}, off
