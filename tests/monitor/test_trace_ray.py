"""The timeline's answers on Ray (executor "ray", both control planes): a planted slow rank (`--inject slow`) at tp=2
is named as the straggler with its layer, its median lateness within 25% of what was planted, read from the ranks'
ledgers and histories as on mp; a clean Ray run names none. One Ray instance for the module (ray_instance)."""
import pytest

from devharness import LLM
from devharness.diagnostics import timeline
from devharness.monitor import trace
from tests.monitor.test_collectives import ledgers_of
from tests.monitor.test_trace import PARAMS, PROMPTS, SLOW_MS, assert_named, check_tef, histories_of

WINDOW = 16


def run_on_ray(control_plane: str, inject: str | None) -> dict:
    with LLM("tiny-llama", tensor_parallel_size=2, distributed_executor_backend="ray", threads_per_worker=1,
             num_kv_blocks=64, ray_control_plane=control_plane, inject=inject) as llm:
        llm.generate(PROMPTS, PARAMS)
        src = trace.Source(ledgers_of(llm), histories_of(llm), {})
    doc = trace.trace_events(src, WINDOW)
    check_tef(doc)
    return doc["otherData"]["answers"]


@pytest.mark.parametrize("control_plane", ["shm", "cgraph"])
def test_a_slow_ray_rank_is_named_with_its_layer(control_plane, ray_instance):
    got = run_on_ray(control_plane, f"slow:rank=1:ms={SLOW_MS:g}:layer=2")
    assert got["steps"] == WINDOW
    assert_named(got["straggler"], 1, 2)
    assert {(c["group"], c["op"]) for c in got["collectives"]} == {("tp0", "all_reduce"), ("tp0", "all_gather")}


def test_a_clean_ray_run_names_no_straggler(ray_instance):
    got = run_on_ray("shm", None)
    assert got["steps"] == WINDOW and got["straggler"] is None, got
    assert "straggler: none" in timeline.render(got)
