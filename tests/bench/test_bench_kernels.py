"""`devharness bench kernels` at its smallest (tiny-llama, one row, a short context, two samples): it names every op
of the registry with both timings (the library form alone for an op without a custom kernel) and the backend
chosen, prints docs/benchmarks.md's tables with --markdown, and --save writes choices that the fast backend reads back. Figures are
never checked: on a shared machine they mean nothing."""
import json
import re

import pytest

from devharness import kernels
from devharness.bench.markdown import parse_table
from devharness.cli import main
from devharness.kernels import cpu, reference

SMALLEST = ["bench", "kernels", "--model", "tiny-llama", "--rows", "1", "--contexts", "16", "--repeats", "2"]
MS = r"\d+\.\d+"


@pytest.fixture(autouse=True)
def built(monkeypatch, tmp_path):
    """The C kernels built (from the usual cache) before DEVHARNESS_CACHE moves the choices to tmp_path."""
    if cpu.library() is None:
        pytest.fail("the C kernels did not build on this machine (a C compiler is part of the set-up)")
    monkeypatch.setenv("DEVHARNESS_CACHE", str(tmp_path))


def run_cli(capsys, argv):
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def printed_choices(out: str) -> dict[str, str]:
    """op -> the backend its `chosen:` line names (the line follows the op's rows)."""
    choices, op = {}, None
    for line in out.splitlines():
        if m := re.match(r"^(\w+)\s", line):
            op = m.group(1)
        elif m := re.match(r"^\s+chosen: (custom|library|custom<=\d+) ", line):
            choices[op] = m.group(1)
    return choices


@pytest.mark.timeout(60)
def test_table_names_every_op_with_both_timings_and_save_writes_the_choices(capsys, tmp_path):
    rc, out, err = run_cli(capsys, SMALLEST + ["--save"])
    assert rc == 0, err
    date = r"\d{4}-\d\d-\d\d \d\d:\d\d"
    assert re.search(rf"^CPU .+, torch threads \d+(, load average .+)?, {date}, model tiny-llama ", out, re.M), out
    for name, op in kernels.OPS.items():
        if op.custom:
            row = rf"^{name}\s+\S.*\s(reference|w @ x\^T|SDPA is_causal)\s+{MS}\s+{MS}\s+{MS}\s+{MS}\s+{MS}x$"
        else:
            row = rf"^{name}\s+\S.*\sreference\s+{MS}\s+{MS}\s+library only$"
        assert re.search(row, out, re.M), (name, out)
    choices = printed_choices(out)
    assert set(choices) == set(kernels.OPS), out
    assert all(choices[name] == "library" for name, op in kernels.OPS.items() if not op.custom), choices
    for name, choice in choices.items():   # each op's line gives the sums it chose by
        if kernels.OPS[name].custom:
            sums = rf"\s+chosen: {choice} \(.*: custom ({MS}) ms, library ({MS}) ms"
            m = re.search(rf"^{name}\s(?:.*\n)*?{sums}", out, re.M)
            assert m, (name, out)
            custom, library = float(m.group(1)), float(m.group(2))
            if choice.startswith("custom<="):   # the split beats both the custom kernel and the library everywhere
                split = re.search(rf"custom up to {choice[8:]} rows, the library above: ({MS}) ms\)", m.group(0))
                assert split and float(split.group(1)) <= min(custom, library) + 1e-4, m.group(0)
            else:
                assert custom == library or (custom < library) == (choice == "custom"), m.group(0)   # equal: rounded
    assert f"saved the choices to {kernels.choices_path()}" in out
    saved = json.loads(kernels.choices_path().read_text())
    assert saved["choices"] == choices and saved["model"] == "tiny-llama" and saved["key"] == kernels.choices_key()
    assert {r["op"] for r in saved["table"]} == set(kernels.OPS)
    assert {n for n, c in kernels.saved_choices().items() if c == "library"} == \
        {name for name, c in choices.items() if c == "library"}
    fast = kernels.kernels_for("fast")
    assert fast.choices == choices
    for name, choice in choices.items():   # a "library" choice runs the reference
        assert (getattr(fast, name) is kernels.OPS[name].reference) == (choice == "library"), name


def test_markdown_prints_the_docs_tables_after_the_run(capsys):
    """--markdown: the text table as without it, then docs/benchmarks.md's section: the machine and date line, each
    op and shape's speedup at each row count (the text rows' speedups, in their order), the choices grouped."""
    rc, out, err = run_cli(capsys, SMALLEST + ["--markdown"])
    assert rc == 0, err
    text, section = out.split("\n| op, shape |", 1)
    choices = printed_choices(text)   # the text output is all there before the section
    assert set(choices) == set(kernels.OPS), text
    assert re.search(r"^.+, \d+ vCPUs, torch [\d.]+\w*, \d+ threads?, model tiny-llama; \d{4}-\d\d-\d\d\.$", text, re.M), out
    rows = parse_table(out, ["op, shape", "1 row"])
    text_speedups = [float(m[1]) for m in re.finditer(r"^\w+\s.*\s(\d+\.\d+)x$", text, re.M)]
    custom_rows = [r for r in rows if r[1] != "library only"]
    assert [r[0].split(",")[0] for r in rows] == [f"`{op}`" for op in ("linear",) * 4 + (
        "gated_linear", "linear_argmax", "argmax", "rms_norm", "add_rms_norm", "rotate", "silu_and_mul", "write_kv",
        "paged_decode", "decode_attention") + ("q_linear",) * 3 + ("q_gated_linear", "q_linear_argmax", "q_embedding",
                                                "prefill_attention")], rows
    assert [r[0] for r in rows if r[0].startswith("`q_")] == [
        "`q_linear`, qkv", "`q_linear`, o", "`q_linear`, down", "`q_gated_linear`, gate_up", "`q_linear_argmax`, lm_head",
        "`q_embedding`"]
    assert [r[0] for r in rows if r[1] == "library only"] == [f"`{n}`" for n, op in kernels.OPS.items() if not op.custom]
    assert [r[0] for r in rows[:4]] == ["`linear`, qkv", "`linear`, o", "`linear`, down", "`linear`, lm_head"]
    assert ["`paged_decode`, context 16"] == [r[0] for r in rows if "paged" in r[0]]
    assert [float(r[1].removesuffix("×")) for r in custom_rows] == text_speedups, (rows, text_speedups)
    assert rows[-1][0] == "`prefill_attention`" and rows[-1][1].endswith("×"), rows   # custom, against SDPA
    runs = {op.strip("` "): r[1] for r in parse_table(out, ["op", "runs"]) for op in r[0].split(",")}
    assert runs == {op: c if not c.startswith("custom<=") else f"custom up to {c[8:]} rows, the library above"
                    for op, c in choices.items()}, (runs, choices)


def test_fast_backend_honours_a_saved_library_choice():
    path = kernels.choices_path()
    path.write_text(json.dumps({"choices": {"rms_norm": "library", "linear": "custom"}}))
    fast = kernels.kernels_for("fast")
    assert fast.choices["rms_norm"] == "library" and fast.rms_norm is reference.rms_norm
    assert fast.choices["linear"] == "custom" and fast.linear is not reference.linear
    assert {n for n, c in kernels.saved_choices().items() if c == "library"} == {"rms_norm"}
    path.unlink()
    assert kernels.kernels_for("fast").choices["rms_norm"] == "custom"


def test_fast_backend_honours_a_saved_row_limit(monkeypatch):
    """"custom<=N": the custom kernel for calls of at most N rows, the library form above."""
    import torch
    calls = []
    path = kernels.choices_path()
    path.write_text(json.dumps({"choices": {"linear": "custom<=8", "write_kv": "custom<=2", "argmax": "custom<=x"}}))
    import dataclasses
    monkeypatch.setitem(kernels.OPS, "linear", dataclasses.replace(
        kernels.OPS["linear"], reference=lambda *a: calls.append(a[0].shape[0]) or "library"))
    fast = kernels.kernels_for("fast")
    assert fast.choices["linear"] == "custom<=8" and fast.choices["argmax"] == "custom"   # a choice not understood
    w = torch.randn(16, 4)
    assert isinstance(fast.linear(torch.randn(8, 4), w), torch.Tensor) and calls == []
    assert fast.linear(torch.randn(9, 4), w) == "library" and calls == [9]
    k_cache, v_cache = torch.zeros(4, 2, 1, 4), torch.zeros(4, 2, 1, 4)
    k = v = torch.ones(3, 1, 4)
    fast.write_kv(k_cache, v_cache, torch.tensor([0, 3, 5]), k, v)   # rows: the slots' (3), the library's
    assert k_cache.view(-1, 1, 4)[[0, 3, 5]].eq(1).all() and k_cache.sum() == 12
    path.unlink()


def test_without_the_c_kernels_only_the_library_forms_are_timed(capsys, monkeypatch):
    monkeypatch.setattr(cpu, "_kernel", None)   # library() settled on None, as where no compiler is found
    monkeypatch.setattr(cpu, "_tried", True)
    rc, out, err = run_cli(capsys, SMALLEST + ["--save"])
    assert rc == 0, err
    assert "the custom kernels cannot be built here" in out and "only the library forms are timed" in out
    assert re.search(rf"^linear\s+qkv 1x128->256\s+(reference|w @ x\^T)\s+{MS}\s+{MS}\s+not built$", out, re.M), out
    assert "nothing saved" in out and not kernels.choices_path().exists()


@pytest.mark.parametrize("argv", [
    ["bench", "kernels", "--rows", "0"],
    ["bench", "kernels", "--rows", "1", "-4"],
    ["bench", "kernels", "--repeats", "many"],
    ["bench", "kernels", "--model", "no-such-model"],
])
def test_bad_arguments_exit_2_with_one_line(capsys, argv):
    rc, out, err = run_cli(capsys, argv)
    assert rc == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("devharness: error: "), err
