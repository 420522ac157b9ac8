"""What the GPU checks share: skipping without CUDA, and a look at where a step's tensors live."""
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
