"""`devharness check` on GPUs: a layout against tp=1 on the GPU, site by site; a planted bug is found there."""
from tests.gpu.cuda import require_gpus

require_gpus(1)

import pytest   # noqa: E402
import torch   # noqa: E402

from devharness.cli import main   # noqa: E402
from devharness.monitor.check import run_check   # noqa: E402

PROMPT = {"prompt_token_ids": [5, 6, 7, 8, 9, 10]}


def test_mp_worker_on_the_gpu_matches_in_process():
    report = run_check("tiny-llama", PROMPT, 1e-4, decode_steps=2, device="cuda", distributed_executor_backend="mp")
    assert report.ok, report.verdict()
    assert len(report.sites) > 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tp=2 needs 2 CUDA devices")
def test_tp2_matches_and_a_dropped_all_reduce_is_named(capsys):
    assert main(["check", "--model", "tiny-llama", "--tp", "2", "--device", "cuda", "--decode-steps", "2"]) == 0
    assert "matches tp=1 at every layer" in capsys.readouterr().out
    report = run_check("tiny-llama", PROMPT, 1e-4, decode_steps=2, device="cuda", tensor_parallel_size=2,
                       distributed_executor_backend="mp", inject="allreduce-drop:layer=1:rank=1")
    first = report.first_divergent
    assert first is not None and (first.step, first.layer, first.site, first.rank) == (0, 1, "attention output", 1), \
        report.verdict()
