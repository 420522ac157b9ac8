"""`devharness check` on models of a short context: synthetic Llamas of 128 and 64 positions (tiny-llama's weights,
its max_position_embeddings lowered). Each check runs with its defaults, fitted to the model and saying so, and
names its planted bugs there as on tiny-llama; a flag of the user's that cannot fit is one line, exit 2, naming it."""
import json
import re

import msgspec
import pytest

from devharness.cli import main
from devharness.model.builtin import TINY_ARCH, write_hf_checkpoint
from devharness.monitor.check_fit import batch_budget, fit_probe

TOL = 1e-4


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """positions -> the path of a tiny Llama checkpoint with that many."""
    root = tmp_path_factory.mktemp("short-context")
    return {n: str(write_hf_checkpoint(root / f"llama{n}", msgspec.structs.replace(TINY_ARCH,
                                                                                  max_position_embeddings=n)))
            for n in (128, 64)}


def check_json(capsys, model, *args) -> tuple[int, dict]:
    code = main(["check", "--model", model, *args, "--json"])
    out = capsys.readouterr().out
    assert len(out.splitlines()) == 1, out
    return code, json.loads(out)


def named(got: dict) -> tuple:
    return tuple(got[k] for k in ("step", "layer", "site", "op", "rank"))


# (check's flags, --inject or None, (step, layer, site, op, rank) it names): the specs the tiny-llama tests plant.
# The default probe (26 tokens) is 2 blocks of 16: the paged_decode bug (a row longer than 2 blocks loses its last)
# shows at 4-token blocks, as test_check_ops plants it.
CASES = [
    (["--tp", "2"], None, None),
    (["--tp", "2"], "allreduce-drop:layer=1:rank=1", (0, 1, "attention output", None, 1)),
    (["--kernels", "fast", "--against", "reference"], None, None),
    (["--kernels", "fast", "--against", "reference"], "kernel:op=rms_norm", (0, 0, "attention", "rms_norm", 0)),
    (["--kernels", "fast", "--against", "reference", "--block-size", "4"], "kernel:op=paged_decode",
     (1, 0, "attention", "paged_decode", 0)),
    (["--batch-invariance"], None, None),
    (["--batch-invariance"], "batch-variant:op=rms_norm", (0, 0, "attention", "rms_norm", 0)),
]


@pytest.mark.parametrize("args, inject, where", CASES)
def test_each_check_runs_with_its_defaults_on_128_positions(llama, capsys, args, inject, where):
    code, got = check_json(capsys, llama[128], *args, *(["--inject", inject] if inject else []))
    batch = "--batch-invariance" in args
    assert len(got["tokens"]["reference"]) == 5 and len(got["tokens"]["target"]) == 5   # the default 4 decode steps
    if batch:   # the default step budget (16 blocks) would chunk a prompt of 384 tokens: fitted to 64 (96)
        assert got["about"]["max_num_batched_tokens"] == 64 and got["about"]["prompt_lengths"][1] == 96
        assert got["about"]["preemptions"] >= 1
        assert got["fitted"] == ["batch plan fitted to the model's 128 positions: a step budget of 64 tokens, a "
                                 "chunked prompt of 96"]
        assert got["verdict"].endswith("; " + got["fitted"][0])
    else:
        assert got["fitted"] == []   # the default probe fits as it is
    if where is None:
        assert code == 0 and got["ok"], got["verdict"]
        assert got["max_rel_diff"] <= got["tolerance"]
        return
    assert code == 1 and not got["ok"] and named(got) == where, got["verdict"]
    assert got["rel_diff"] > got["tolerance"]


def test_64_positions_the_smallest_context_every_check_fits(llama, capsys):
    """The batch check's plan at its smallest (a budget of 2 blocks), and the layout's default probe shortened to
    make room for the decode steps asked."""
    code, got = check_json(capsys, llama[64], "--batch-invariance")
    assert code == 0 and got["ok"], got["verdict"]
    assert got["about"]["max_num_batched_tokens"] == 32 and got["about"]["prompt_lengths"][1] == 48
    assert got["about"]["preemptions"] >= 1
    code, got = check_json(capsys, llama[64], "--tp", "2", "--decode-steps", "50")
    assert code == 0 and got["ok"], got["verdict"]
    assert len(got["tokens"]["target"]) == 51 and got["fitted"] == [
        "probe shortened to 13 tokens to fit the model's 64 positions"]
    assert re.fullmatch(r"check: tp=2 pp=1 matches tp=1 at every layer \(max relative diff \S+, tolerance 1e-04\); "
                        r"probe shortened to 13 tokens to fit the model's 64 positions", got["verdict"])


@pytest.mark.parametrize("args, message", [
    (["--tp", "2", "--decode-steps", "500"], "--decode-steps 500: at most 126 fit in the model's 128 positions"),
    (["--tp", "2", "--prompt", "x" * 200], "--prompt has 201 tokens: at most 127 fit in the model's 128 positions"),
    (["--kernels", "fast", "--against", "reference", "--prompt", "Hello", "--decode-steps", "125"],
     "--decode-steps 125 after --prompt's 6 tokens takes 132 positions, more than the model's 128 positions: "
     "give --decode-steps 121 or fewer"),
    (["--batch-invariance", "--decode-steps", "127"], "--decode-steps 127: at most 126 fit"),
    (["--batch-invariance", "--block-size", "64"], "--block-size 64: the batch check needs requests of 4 blocks "
                                                   "(256 positions), more than the model's 128 positions"),
    (["--batch-invariance", "--max-model-len", "40"], "give --block-size 8 or less (or --max-model-len 64)"),
])
def test_flags_that_cannot_fit_are_one_line_exit_2(llama, capsys, args, message):
    assert main(["check", "--model", llama[128]] + args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("ids, steps, given, want", [
    (26, 4, (False, False), (26, 4, [])),                                        # fits as it is
    (26, 110, (False, True), (17, 110, ["probe shortened to 17 tokens"])),      # the default prompt cut
    (26, 110, (True, False), (26, 101, ["decode steps cut to 101"])),           # the default steps lowered
    (125, 4, (True, False), (125, 2, ["decode steps cut to 2"])),
    (26, 200, (False, False), (1, 126, ["probe shortened to 1 token", "decode steps cut to 126"])),
])
def test_fit_probe_changes_only_what_the_user_did_not_give(ids, steps, given, want):
    ids = list(range(ids))
    got_ids, got_steps, notes = fit_probe(ids, steps, 128, "the model's 128 positions", *given)
    assert (len(got_ids), got_steps) == want[:2] and got_ids == ids[:len(got_ids)]
    assert [n.split(" to fit ")[0] for n in notes] == want[2]
    assert len(got_ids) + got_steps + 1 <= 128


def test_batch_budget_fits_its_chunked_prompt_and_decodes():
    for context in range(64, 2049, 16):
        budget = batch_budget(16, 4096, context)
        assert budget % 32 == 0 and 32 <= budget <= 256 and budget * 3 // 2 + 16 <= context
        assert budget == 256 or (budget + 32) * 3 // 2 + 16 > context   # the largest that fits
