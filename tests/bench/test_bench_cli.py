"""`devharness bench executor`, `bench debug-overhead` and `bench throughput --pipeline` at their smallest
settings: they run, print their ratio lines and exit 0; bad arguments exit 2 with one line. Figures are never checked: on a
shared machine only the real runs' ratios mean anything."""
import re

import pytest

from devharness.bench.markdown import parse_table
from devharness.cli import main


RATIO = r"\d+\.\d+x"
MACHINE = r"^.+, \d+ vCPUs, torch [\d.]+\w*, \d+ threads?, .*; \d{4}-\d\d-\d\d\.$"   # --markdown's first line


def times(cell: str) -> float:
    """A docs table's ratio cell ("1.21×", "**1.21×**") as a number."""
    return float(cell.strip("*").removesuffix("×"))


def run_cli(capsys, argv: list[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.timeout(240)
def test_bench_executor_prints_ratios(capsys, ray_instance):   # a connected Ray is used as it is
    # Every case but the Compiled Graph (tests/executor/test_ray.py runs that one): an engine fewer to start.
    rc, out, err = run_cli(capsys, ["bench", "executor", "--rounds", "1", "--steps-per-round", "2", "--tp", "1",
                                    "--pp", "2", "--decode-batch", "2", "--cases", "uni,mp,ray-actor-calls,ray-shm",
                                    "--markdown"])
    assert rc == 0, err
    empty, decode = out.split("empty step (", 1)[1].split("decode step,", 1)
    text = {}   # (case, kind) -> (median us, vs mp) as the text table prints them
    for case in ("uni", "mp", "ray-actor-calls", "ray-shm"):
        m = re.search(rf"^\s+{case}\s+(\d+)\s+\d+\s+({RATIO})$", empty, re.M)
        assert m, (case, out)
        text[case, "empty"] = (int(m[1]), m[2])
    for case in ("uni", "mp", "ray-shm"):
        m = re.search(rf"^\s+{case}\s+(\d+)\s+\d+\s+({RATIO})$", decode.split("default Ray mode", 1)[0], re.M)
        assert m, (case, out)
        text[case, "decode"] = (int(m[1]), m[2])
    # --markdown: after the text, docs/benchmarks.md's table of the same medians (the default Ray mode in bold).
    assert re.search(MACHINE, out, re.M), out
    rows = parse_table(out, ["control plane", "empty step", "vs mp", "decode step (2 requests)", "vs mp"])
    assert [r[0] for r in rows] == ["uni (1 worker, reference)", "mp (shared-memory ring)",
                                    "Ray's floor: plain actor calls to no-op actors",
                                    "**ray, shared-memory ring (default)**"], rows
    for row, case in zip(rows, ("uni", "mp", "ray-actor-calls", "ray-shm")):
        us, vs_mp = text[case, "empty"]
        assert row[1].strip("*") == f"{us} µs" and times(row[2]) == float(vs_mp[:-1]), (row, text)
        if case == "ray-actor-calls":
            assert row[3:] == ["", ""], row
            continue
        us, vs_mp = text[case, "decode"]
        assert abs(float(row[3].strip("*").removesuffix(" ms")) * 1000 - us) <= 51, (row, text)
        assert times(row[4]) == float(vs_mp[:-1]), (row, text)
    floor = re.search(r"^The default \(shared-memory ring\) is (\d+\.\d+)× Ray's plain-actor-call floor\.$", out, re.M)
    assert floor and abs(float(floor[1]) - text["ray-shm", "empty"][0] / text["ray-actor-calls", "empty"][0]) <= \
        0.01 + 0.02 * float(floor[1]), out
    # No-op actors run no model: the floor has no decode step.
    assert not re.search(r"^\s+ray-actor-calls\s", decode.split("default Ray mode", 1)[0], re.M), out
    assert re.search(rf"empty step:\s+ray-\w+ = {RATIO} mp .*, {RATIO} plain actor calls to no-op actors", out), out
    assert re.search(rf"decode step:\s+ray-\w+ = {RATIO} mp", out), out
    assert "bare round trip" not in out and "echo" not in out


@pytest.mark.timeout(240)
def test_bench_debug_overhead_prints_ratios(capsys):
    # On mp (no Ray to start): the worker-state part goes through the workers' profiler, which every executor carries.
    rc, out, err = run_cli(capsys, ["bench", "debug-overhead", "--rounds", "1", "--num-requests", "2",
                                    "--output-len", "4", "--prompt-len", "8", "--phase-steps", "5", "--ab-steps", "10",
                                    "--decode-batch", "2", "--tp", "1", "--executor", "mp", "--markdown"])
    assert rc == 0, err
    for case in ("no debug", "--debug, no client", "--debug, client attached"):
        assert re.search(rf"^\s+{re.escape(case)}\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+{RATIO}$", out, re.M), (case, out)
    assert re.search(rf"--debug with no client: {RATIO} no debug", out), out
    assert re.search(r"rank 0: [\d.]+ phase changes", out), out
    assert re.search(r"time in the recorder = [\d.]+% of a", out), out
    assert re.search(r"A/B, rank 0: a step with the recorder costs [-+]\d+ us of CPU time \(95% CI", out), out
    assert re.search(r"A/B, recorder installed / removed: [-+][\d.]+% of a step", out), out
    assert re.search(r"A/B, collective ledger installed / removed: [-+]\d+ us = [-+][\d.]+% of a step", out), out
    assert re.search(r"flight recorder \(always on, last 64 steps at the driver\)", out), out
    assert re.search(r"inside its calls: [\d.]+ us per step = [\d.]+% of a step", out), out
    assert re.search(r"A/B, on / off by turns: [-+]\d+ us a step \(95% CI .* pairs\) = [-+][\d.]+%", out), out
    records = re.search(r"driver step records \(always on, the timeline's driver process\): ([\d.]+) us per step = "
                        r"([\d.]+%) of a step", out)
    assert records, out
    # Part 4: the KV sanitizer, two engines at tp=1 stepped by turns; its CPU time by part.
    assert re.search(r"KV sanitizer \(tiny-llama, tp=1, 2 requests x 4 tokens, 1 rounds; in each, the two engines "
                     r"step by turns\)", out), out
    assert re.search(rf"with the sanitizer: {RATIO} without \(median of per-round ratios, 95% CI [\d.]+ to [\d.]+; "
                     rf"rounds [\d.]+ to [\d.]+; cost [-+][\d.]+%", out), out
    # --markdown: docs/benchmarks.md's table, each figure as the text gives it.
    assert re.search(MACHINE, out, re.M), out
    rows = parse_table(out, ["", "figure", "target"])
    no_client = re.search(r"--debug with no client: (\d+\.\d+)x no debug", out)[1]
    attached = re.search(r"^\s+--debug, client attached\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+(\d+\.\d+)x$", out, re.M)[1]
    state = re.search(r"A/B, recorder installed / removed: ([-+][\d.]+%) of a step \(95% CI ([-+][\d.]+%) to ([-+][\d.]+%)", out)
    ledger = re.search(r"A/B, collective ledger installed / removed: ([-+]\d+) us = ([-+][\d.]+%) of a step \(95% CI "
                       r"([-+][\d.]+%) to ([-+][\d.]+%)", out)
    flight = re.search(r"A/B, on / off by turns: .* = ([-+][\d.]+%) \(CI ([-+][\d.]+%) to ([-+][\d.]+%)\)", out)
    sanitizer = re.search(r"with the sanitizer: (\d+\.\d+)x without \(median of per-round ratios, 95% CI ([\d.]+) to "
                          r"([\d.]+);", out)
    inside = re.search(r"inside its calls: [\d.]+ us per step = ([\d.]+%)", out)[1]
    cpu = re.search(r"in CPU time \(the engines' thread, descheduling left out\): (\d+\.\d+)x without", out)[1]
    parts = re.search(r"of its steps' CPU time \(1 more rounds, each call timed\): the KV checksums ([\d.]+)%, the "
                      r"workers' generation checks ([\d.]+)%, the driver's block-manager checks ([\d.]+)% \((\d+) "
                      r"blocks checksummed, (\d+) verified\)", out)
    assert [r[1:] for r in rows] == [
        [f"{no_client}× (median of 1 rounds)", "≥ 0.95×"], [f"{attached}×", ""],
        [f"{state[1]} (95% CI {state[2]} to {state[3]})", "≤ 2%"],
        [f"{ledger[1]} µs = {ledger[2]} (95% CI {ledger[3]} to {ledger[4]})", "≤ 1%"],
        [f"{records[1]} µs = {records[2]} of a step", "≤ 1%"],
        [f"{flight[1]} (95% CI {flight[2]} to {flight[3]}); inside its calls {inside}", "≤ 1%"],
        [f"tiny-llama {sanitizer[1]}× (95% CI {sanitizer[2]} to {sanitizer[3]}, 1 rounds); in CPU time {cpu}×; in the "
         f"checksums {parts[1]}% of its steps' CPU time ({parts[4]} blocks checksummed, {parts[5]} verified), in the "
         f"driver's and the workers' bookkeeping checks {parts[3]}% and {parts[2]}%", "≥ 0.95×"]], rows
    assert [r[0].split(",")[0] for r in rows] == ["`--debug`", "`--debug`", "always-on worker state",
                                                  "always-on collective ledger",
                                                  "driver step records (the timeline's driver process)",
                                                  "flight recorder (last 64 steps)",
                                                  "KV sanitizer with its KV checksums (two engines at tp=1"], rows


@pytest.mark.timeout(240)
def test_bench_debug_overhead_numerics_part(capsys):
    # The numerics check installed and removed by turns inside the mp workers, and two engines' tokens/s side by side.
    rc, out, err = run_cli(capsys, ["bench", "debug-overhead", "--part", "numerics", "--rounds", "1", "--num-requests",
                                    "2", "--output-len", "4", "--prompt-len", "8", "--ab-steps", "10",
                                    "--decode-batch", "2", "--tp", "2", "--executor", "mp", "--markdown"])
    assert rc == 0, err
    ab = re.search(r"numerics check \(tiny-llama, tp=2 pp=1, mp\):\n  decode steps at batch 2, installed / removed by "
                   r"turns inside the workers: ([-+]\d+) us of CPU time a step \(95% CI [-+]\d+ to [-+]\d+; \d+ pairs; "
                   r"slowest rank, whose step takes \d+ us of CPU: ([-+][\d.]+%) of it\) = ([-+][\d.]+%) of a [\d.]+ ms step "
                   r"at the driver \(CI ([-+][\d.]+%) to ([-+][\d.]+%)\); a debug-mode default only within 3% of "
                   r"both: (NOT )?met", out)
    assert ab, out
    ratio = re.search(rf"two engines: with the check ({RATIO[:-1]})x without \(median of 1 per-round ratios\)", out)
    assert ratio, out
    rows = parse_table(out, ["", "figure", "target"])
    assert len(rows) == 1 and rows[0][0].startswith("numerics check, tiny-llama, tp=2 pp=1, mp: decode step at batch 2")
    assert rows[0][1:] == [f"{ab[1]} µs = {ab[3]} (95% CI {ab[4]} to {ab[5]}) of {rows[0][1].split(' of ')[1].split()[0]}"
                           f" ms ({ab[2]} of the rank's CPU time); two engines, tokens/s {ratio[1]}×", "≤ 3%"], rows


@pytest.mark.timeout(240)
def test_bench_pipeline_prints_paired_and_fastest_round_ratios(capsys):
    """The three cases' table, the median of the per-round ratios (within what the table's slowest and fastest
    rounds allow) and the ratios of each case's fastest round (the table's max column, divided)."""
    rc, out, err = run_cli(capsys, ["bench", "throughput", "--pipeline", "--model", "tiny-llama", "--num-requests", "6",
                                    "--rounds", "2", "--output-len", "4", "8", "--markdown"])
    assert rc == 0, err
    table = {}
    for case in ("pp=1", "pp=2, 1 batch in flight", "pp=2, 2 batches in flight"):
        m = re.search(rf"^\s+{re.escape(case)}\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+{RATIO}$", out, re.M)
        assert m, (case, out)
        table[case] = [float(v) for v in m.groups()]   # median, min, max tokens/s
    many, one, single = table["pp=2, 2 batches in flight"], table["pp=2, 1 batch in flight"], table["pp=1"]
    paired = re.search(rf"^\s+pp=2, 2 batches in flight: ({RATIO}) pp=2, 1 batch in flight \(target >= 1.6x: "
                       rf"(met|NOT met)\), ({RATIO}) pp=1 \(target >= 0.9x: (met|NOT met)\)$", out, re.M)
    fastest = re.search(rf"^\s+fastest rounds: pp=2, 2 batches in flight: ({RATIO}) pp=2, 1 batch in flight \(target "
                        rf">= 1.6x: (met|NOT met)\), ({RATIO}) pp=1 \(target >= 0.9x: (met|NOT met)\)$", out, re.M)
    assert paired and fastest, out
    for m in (paired, fastest):
        for ratio, verdict, target in ((m.group(1), m.group(2), 1.6), (m.group(3), m.group(4), 0.9)):
            assert (verdict == "met") == (float(ratio[:-1]) >= target), m.group(0)
    assert float(fastest.group(1)[:-1]) == pytest.approx(many[2] / one[2], abs=2e-3)
    assert float(fastest.group(3)[:-1]) == pytest.approx(many[2] / single[2], abs=2e-3)
    assert many[1] / one[2] - 2e-3 <= float(paired.group(1)[:-1]) <= many[2] / one[1] + 2e-3
    # --markdown: docs/benchmarks.md's table of the same figures.
    assert re.search(MACHINE, out, re.M), out
    rows = parse_table(out, ["", "this run", "target"])
    assert [r[0] for r in rows] == ["pp=1 (1 worker, 2 threads)", "pp=2, 1 batch in flight", "pp=2, 2 batches in flight",
                                    "**2 in flight / 1 in flight**: median of rounds (fastest rounds)",
                                    "**2 in flight / pp=1**: median of rounds (fastest rounds)"], rows
    assert [float(r[1].removesuffix(" tokens/s")) for r in rows[:3]] == [single[0], one[0], many[0]], (rows, table)
    assert (rows[3][2], rows[4][2]) == ("≥ 1.6×", "≥ 0.9×"), rows
    for row, i in ((rows[3], 1), (rows[4], 3)):
        median, fastest_round = re.fullmatch(r"\*\*(\d+\.\d+)×\*\* \((\d+\.\d+)×\)", row[1]).groups()
        assert float(median) == float(paired.group(i)[:-1]) and float(fastest_round) == float(fastest.group(i)[:-1]), \
            (row, out)


@pytest.mark.timeout(240)
def test_bench_stories_prints_on_and_off_side_by_side(capsys):
    """`bench throughput --stories`: the scheduler's side with stories on and off, the StoryBook's own calls within
    it (more than nothing with stories on: the clock sees them), and the docs table with the same figures."""
    rc, out, err = run_cli(capsys, ["bench", "throughput", "--stories", "--model", "tiny-llama", "--num-requests", "6",
                                    "--rounds", "2", "--prompt-len", "8", "24", "--output-len", "4", "8", "--markdown"])
    assert rc == 0, err
    rounds = re.findall(r"^round \d: stories on: scheduler ([\d.]+) ms .*, stories off: scheduler ([\d.]+) ms .*; "
                        r"the StoryBook's calls ([\d.]+) ms$", out, re.M)
    assert len(rounds) == 2, out
    assert all(0 < float(story) <= float(on) and float(off) > 0 for on, off, story in rounds), rounds
    side = re.search(r"stories on ([\d.]+) us, off ([\d.]+) us", out)
    own = re.search(r"the StoryBook's own calls: ([\d.]+) us a step, ([\d.]+)% of the scheduler's side", out)
    assert side and own and 0 < float(own.group(2)) <= 100, out
    assert re.search(MACHINE, out, re.M), out
    rows = parse_table(out, ["", "figure"])
    assert rows[0][1].startswith(f"{side.group(1)} / {side.group(2)} µs") and rows[1][1].startswith(own.group(1)), rows
    assert re.search(r"target ≤ 1%: (met|not met)$", rows[3][1]), rows


def test_bench_timeline_prints_where_a_step_goes_and_what_trace_takes(capsys):
    rc, out, err = run_cli(capsys, ["bench", "timeline", "--models", "tiny-llama", "--decode-batch", "2", "--markdown"])
    assert rc == 0, err
    assert re.search(MACHINE, out, re.M), out
    header = ["model, case", "tokens/s", "rank's step (ms)", "driver's own (ms)", "prepare", "forward", "collective",
              "send", "recv", "sample", "bubble per stage"]
    rows = {r[0]: dict(zip(header, r)) for r in parse_table(out, header)}
    assert list(rows) == [f"tiny-llama, {c}" for c in ("tp=1", "tp=2", "pp=2, 1 batch in flight",
                                                       "pp=2, 2 batches in flight")], rows
    assert rows["tiny-llama, tp=2"]["collective"].endswith("%") and rows["tiny-llama, tp=1"]["collective"] == ""
    for case in ("pp=2, 1 batch in flight", "pp=2, 2 batches in flight"):   # a bubble per stage, the hand-offs shown
        row = rows[f"tiny-llama, {case}"]
        assert len(row["bubble per stage"].split(", ")) == 2 and row["recv"].endswith("%"), row
    # Two batches in flight against one: the tokens/s ratio next to the busy fractions' ratio and the bubbles.
    pct = r"\d+%, \d+%"
    assert re.search(rf"^tiny-llama, pp=2, 2 batches in flight against 1: tokens/s [\d.]+×, busy fraction [\d.]+× "
                     rf"\(bubble per stage {pct} -> {pct}\)$", out, re.M), out
    assert re.search(r"^trace of 64 steps, tiny-llama tp=2 x pp=2 \(4 ranks\): reading the ranks \d+ ms, writing the "
                     r"file \d+ ms \([\d.]+ MB\)$", out, re.M), out


@pytest.mark.parametrize("argv", [
    ["bench", "executor", "--rounds", "0"],
    ["bench", "executor", "--steps-per-round", "many"],
    ["bench", "executor", "--cases", "mp,warp"],
    ["bench", "debug-overhead", "--output-len", "-3"],
    ["bench", "debug-overhead", "--executor", "uni"],
    ["bench", "throughput", "--pipeline", "--executor", "uni"],
    ["bench", "throughput", "--pipeline", "--rounds", "0"],
    ["bench", "restart", "--executor", "uni"],
    ["bench", "restart", "--kill-rank", "2"],
    ["bench", "load", "--streams", "1,0"],
    ["bench", "load", "--streams", "many"],
    ["bench", "timeline", "--decode-batch", "0"],
    ["bench", "timeline", "--slow-ms", "0"],
    ["bench", "timeline", "--slow-ms", "slow"],
    ["bench", "single-stream", "--output-len", "1"],
    ["bench", "single-stream", "--tp", "2"],
    ["bench", "single-stream", "--llama-bench", "/no/such/llama-bench"],
])
def test_bad_arguments_exit_2_with_one_line(capsys, argv):
    rc, out, err = run_cli(capsys, argv)
    assert rc == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("devharness: error: "), err


def test_throughput_pp_2_is_the_pipeline_comparison(capsys):
    # `--pp 2` alone means the pipeline comparison (pp=1 vs 1 and 2 batches in flight): it says so when refused.
    rc, out, err = run_cli(capsys, ["bench", "throughput", "--pp", "2", "--executor", "uni"])
    assert rc == 2 and "--pipeline runs several workers" in err, err


def test_restart_markdown_is_its_rounds_median_range_and_ratio():
    """bench restart --markdown's row from the rounds it measured (the bench itself is not run here: it SIGKILLs
    workers and waits out their restarts): the median, the range, when the death was seen, the median over the cold
    start."""
    from devharness.bench.restart import markdown_blocks
    rounds = [{"detected_s": 0.09, "restarted_s": 1.48, "answered_s": 1.5, "same_tokens": True},
              {"detected_s": 0.07, "restarted_s": 0.98, "answered_s": 1.0, "same_tokens": True},
              {"detected_s": 0.10, "restarted_s": 1.04, "answered_s": 1.1, "same_tokens": True}]
    (table,) = markdown_blocks("mp", 3.30, rounds)
    assert table.header == ["", "cold start", "SIGKILL → serving again (median of 3)", "vs cold start"]
    assert table.rows == [["mp", "3.30 s", "1.04 s (0.98–1.48 s; the death seen in 0.07–0.10 s)", "0.32×"]]
    assert table.lines()[1] == "|---|---|---|---|"
