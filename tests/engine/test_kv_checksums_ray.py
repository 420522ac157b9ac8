"""The KV checksums on Ray actors. On the shared-memory control plane only the output rank returns tokens: with the KV
sanitizer every rank answers each step, so a kv-bitflip on a rank that returns none (rank 1 at tp=2, the first stage's
rank at pp=2) still ends the request reading it with that rank's account, the others go on, and a bundle is written;
a kv-stale-hit at tp=2 is named by both ranks. A compiled graph returns every rank's result anyway."""
import pytest

from devharness import LLM
from tests.engine.test_kv_checksums import ONE, assert_bitflip_named, assert_stale_hit_named
from tests.executor.test_ray import shm_segments_of, wait_until


def ray_layout(mode: str, tp: int = 1, pp: int = 1) -> dict:
    return {"distributed_executor_backend": "ray", "ray_control_plane": mode, "tensor_parallel_size": tp,
            "pipeline_parallel_size": pp}


@pytest.mark.parametrize("layout, layer, rank", [(ray_layout("shm", tp=2), 2, 1), (ray_layout("shm", pp=2), 1, 0),
                                                 (ray_layout("cgraph", tp=2), 2, 1)],
                         ids=["shm-tp2", "shm-pp2", "cgraph-tp2"])
def test_a_bitflip_on_a_rank_that_returns_no_tokens_is_named(ray_instance, layout, layer, rank, tmp_path, caplog):
    assert_bitflip_named(layout, layer, rank, tmp_path, caplog)


def test_a_stale_hit_is_named_by_both_ranks(ray_instance, tmp_path, caplog):
    assert_stale_hit_named(ray_layout("shm", tp=2), tmp_path, caplog)


def test_without_the_sanitizer_only_the_output_rank_answers(ray_instance):
    """The steps' cost without the KV sanitizer is unchanged: one answer a step, the output rank's. With it each rank
    answers on a ring of its own, gone with the workers."""
    with LLM("tiny-llama", threads_per_worker=1, kv_sanitizer=False, **ray_layout("shm", tp=2)) as off, \
            LLM("tiny-llama", threads_per_worker=1, kv_sanitizer=True, **ray_layout("shm", tp=2)) as on:
        assert off.engine.core.executor.answering == [0] and list(off.engine.core.executor._res.responses) == [0]
        assert on.engine.core.executor.answering == [0, 1] and list(on.engine.core.executor._res.responses) == [0, 1]
        prompts = [{"prompt_token_ids": [5, 6, 7] * 6}, {"prompt_token_ids": [9] * 20}]
        assert [o.outputs[0].token_ids for o in on.generate(prompts, ONE)] == \
            [o.outputs[0].token_ids for o in off.generate(prompts, ONE)]
        pids = on.engine.core.executor.worker_pids
        assert len(shm_segments_of(pids)) == 2
    assert wait_until(lambda: not shm_segments_of(pids), 10), "a result ring outlived shutdown"
