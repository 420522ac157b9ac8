"""Faults planted on purpose (ArmFault): at a step's start, or inside the model at a layer's start
through the layer hook the worker installs; each fires once, on the rank it names."""
import pytest

from devharness import LLM, SamplingParams
from devharness.debug.breakpoints import InjectedFault
from devharness.protocol.messages import ArmFault, BreakpointSpec

PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-llama", distributed_executor_backend="uni", num_kv_blocks=64) as llm:
        yield llm


def test_a_fault_armed_for_a_layer_fires_there_once(llm):
    step = llm.engine.core.scheduler.step_count + 1
    assert llm.engine.workers.control(ArmFault(BreakpointSpec(layer=1))) == [True]   # any step: the next
    with pytest.raises(InjectedFault, match=f"fault injected on rank 0 at step {step}, layer 1$") as info:
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], PARAMS)
    # Raised from the model's layer loop, inside the forward, not at the step's start.
    assert any(f.name == "forward" and f.filename.endswith("decoder.py") for f in _frames(info.value))
    assert len(llm.generate([{"prompt_token_ids": [1, 2, 3]}], PARAMS)[0].outputs[0].token_ids) == 4   # once


def test_a_fault_for_another_rank_is_not_kept(llm):
    assert llm.engine.workers.control(ArmFault(BreakpointSpec(rank=1, layer=0))) == [False]
    assert len(llm.generate([{"prompt_token_ids": [4, 5]}], PARAMS)[0].outputs[0].token_ids) == 4


def _frames(exc):
    import traceback
    return traceback.extract_tb(exc.__traceback__)


@pytest.mark.parametrize("spec, message", [
    ("allreduce-drop:layer=1", "allreduce-drop needs rank="),
    ("allreduce-drop:layer=x:rank=1", "layer must be a number"),
    ("teleport:rank=1", "unknown fault 'teleport'"),
    ("raise:step=0:rank=0", "step=0 is out of range"),
    ("rope-offset:rank=1:layer=2", "'layer=2' is not one of rank="),
    ("rope-offset", "rope-offset needs rank="),
    ("kv-corrupt:rank=1", "kv-corrupt needs layer="),
    ("kv-corrupt:layer=-1:rank=1", "layer=-1 is out of range"),
    ("allreduce-drop:layer=9:rank=1", "layer 9 does not exist"),
    ("kv-corrupt:layer=4:rank=1", "layer 4 does not exist"),
    ("raise:step=2:rank=5", "rank 5 does not exist"),
    ("rope-offset:rank=4", "rank 4 does not exist"),
    ("kv-corrupt:layer=1:rank=3", "rank 3 does not run layer 1 (its pipeline stage 1 runs layers 2..3)"),
    ("allreduce-drop:layer=2:rank=1", "rank 1 does not run layer 2 (its pipeline stage 0 runs layers 0..1)"),
    ("kernel", "kernel needs op="),
    ("kernel:op=linear", "kernel has no bug for op 'linear' (one of paged_decode, rms_norm, q_linear)"),
    ("kernel:op=paged_decode:blocks=0", "blocks=0 is out of range"),
    ("kernel:op=rms_norm:rank=4", "rank 4 does not exist"),
    ("batch-variant:op=paged_decode", "batch-variant has no bug for op 'paged_decode'"),
    ("batch-variant:op=rms_norm:layer=1", "'layer=1' is not one of op=, rank="),
    ("slow:rank=1", "slow needs ms="),
    ("slow:layer=1", "slow needs ms="),
    ("slow:rank=1:ms=0", "ms=0 is out of range"),
    ("slow:rank=1:ms=inf", "ms=inf is out of range"),
    ("slow:rank=1:ms=fast", "ms must be a number, not 'fast'"),
    ("slow:rank=1:ms=20:step=0", "step=0 is out of range"),
    ("slow:rank=1:ms=20:seconds=2", "'seconds=2' is not one of rank=, ms=, layer=, step="),
    ("slow:rank=4:ms=20", "rank 4 does not exist"),
    ("slow:rank=1:ms=20:layer=2", "rank 1 does not run layer 2 (its pipeline stage 0 runs layers 0..1)"),
])
def test_a_bad_spec_is_one_line_exit_2(spec, message, capsys):
    from devharness.cli import main
    assert main(["generate", "--prompt", "hi", "--tp", "2", "--pp", "2", "--inject", spec]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_a_stall_on_a_lone_rank_is_refused(capsys):
    from devharness.cli import main
    assert main(["generate", "--prompt", "hi", "--inject", "stall:step=1:rank=0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "stall: needs more than one rank" in err and len(err.splitlines()) == 1, err


def test_a_slow_rank_on_its_own_is_refused(capsys):
    from devharness.cli import main
    assert main(["generate", "--prompt", "hi", "--inject", "slow:rank=0:ms=20"]) == 2
    err = capsys.readouterr().err.strip()
    assert "slow: needs more than one rank" in err and len(err.splitlines()) == 1, err


def test_a_slow_spec_reads_its_defaults():
    from devharness.fault_spec import FaultSpec, parse
    assert parse("slow:rank=1:ms=25") == parse("slow:ms=25:rank=1")
    got = parse("slow:rank=1:ms=25.5:layer=3:step=4")
    assert (got.kind, got.rank, got.ms, got.layer, got.step) == ("slow", 1, 25.5, 3, 4)
    assert (parse("slow:rank=1:ms=25").layer, parse("slow:rank=1:ms=25").step) == (None, None)
    assert parse("slow:ms=25") == FaultSpec(kind="slow", ms=25.0) and parse("slow:ms=25").rank is None   # every rank


def test_a_uniformly_slow_model_fits_a_lone_rank_and_checks_its_layer():
    """Without rank= every rank is slow: no peer need be held up, so one rank is no error; a layer still must
    exist."""
    from devharness.debug.faults import check_fits
    from devharness.fault_spec import parse
    check_fits(parse("slow:ms=20"), world_size=1, num_layers=4, tp_size=1)
    check_fits(parse("slow:ms=20:layer=3"), world_size=4, num_layers=4, tp_size=2)
    with pytest.raises(ValueError, match="layer 4 does not exist"):
        check_fits(parse("slow:ms=20:layer=4"), world_size=4, num_layers=4, tp_size=2)


def test_replay_with_a_dropped_all_reduce_names_the_first_differing_step(tmp_path, capsys):
    from devharness.cli import main
    d = tmp_path / "rec"
    with LLM("tiny-llama", distributed_executor_backend="uni", num_kv_blocks=64, record_dir=str(d)) as rec:
        rec.generate([{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10]}], PARAMS)
    args = ["replay", str(d), "--tp", "2", "--executor", "mp", "--threads-per-worker", "1"]
    assert main(args) == 0
    assert capsys.readouterr().out.startswith("replay: 4 steps, all tokens match (tp=2 pp=1 mp, kernels fast)")
    assert main(args + ["--inject", "allreduce-drop:layer=1:rank=1"]) == 1
    assert capsys.readouterr().out.startswith("replay: step 1 differs: request ")


def test_inject_raise_fails_the_step_it_names():
    with LLM("tiny-llama", distributed_executor_backend="uni", num_kv_blocks=64, inject="raise:step=2:rank=0") as llm:
        with pytest.raises(InjectedFault, match="fault injected on rank 0 at step 2$"):
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], PARAMS)


def test_a_planted_fault_changes_the_output_and_leaves_with_its_engine(llm):
    from devharness.debug import faults
    from devharness.kernels import OPS
    prompt = [{"prompt_token_ids": [1, 2, 3, 4, 5]}]
    clean = llm.generate(prompt, PARAMS)[0].outputs[0].token_ids
    with LLM("tiny-llama", distributed_executor_backend="uni", num_kv_blocks=64, inject="rope-offset:rank=0") as bad:
        worker = bad.engine.workers.worker
        kernels = worker.runner.kernels
        # Planted from debug/ by wrapping the worker's own rotate op: the model and its hook sites know nothing.
        assert worker.planted is not None and worker.planted.ops[:2] == (kernels, "rotate")
        assert kernels.rotate is not worker.planted.ops[2] and kernels.rotate is not OPS["rotate"].reference
        assert bad.generate(prompt, PARAMS)[0].outputs[0].token_ids != clean
    assert worker.planted is None              # an in-process worker's fault ends with its engine
    assert llm.generate(prompt, PARAMS)[0].outputs[0].token_ids == clean


def test_a_uniformly_slow_layer_is_planted_on_the_ranks_whose_stage_runs_it():
    """slow:ms=N:layer=L without rank=: at tp=2 x pp=2 with 4 layers, the ranks of stage 1 (layers 2..3) plant it at
    layer 3, those of stage 0 plant nothing; without layer= each plants it at its stage's first layer."""
    from types import SimpleNamespace

    from devharness.debug import faults
    from devharness.fault_spec import parse
    from devharness.model.hooks import HookSet

    def worker(rank):
        info = SimpleNamespace(rank=rank, tp_size=2, pp_size=2, pp_rank=rank // 2)
        runner = SimpleNamespace(src=SimpleNamespace(arch=SimpleNamespace(num_hidden_layers=4)), info=info,
                                 layer_partition=None, hooks=HookSet(), kernels=SimpleNamespace(backend="fast"))
        return SimpleNamespace(info=info, runner=runner, recorder=None, planted=None)

    workers = [worker(r) for r in range(4)]
    assert [faults.install(parse("slow:ms=5:layer=3"), w) for w in workers] == [False, False, True, True]
    assert [w.planted.hooks.layer for w in workers[2:]] == [3, 3]
    workers = [worker(r) for r in range(4)]
    assert all(faults.install(parse("slow:ms=5"), w) for w in workers)
    assert [w.planted.hooks.layer for w in workers] == [0, 0, 2, 2]
