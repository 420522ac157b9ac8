"""`devharness bench single-stream` at its smallest, on a tiny GGUF file in Q4_1 and Q8_0 written here: its table
has a row per case and per read limit, each "of its read limit" and "vs llama.cpp" computed from the rows' own
tokens/s, and the bytes a token reads are the file's (counted apart, from the file's tensors). llama.cpp's row comes
from a stand-in (llama-cpp-python is an optional extra, never a test dependency) whose tokens come out at a known
rate. Figures are never checked against a bound: on a shared machine only the real runs' ratios mean anything."""
import re

import gguf
import numpy as np
import pytest

from devharness.bench import single_stream
from devharness.bench.markdown import parse_table
from tests.bench.test_bench_cli import MACHINE, run_cli, times
from tests.model.families import FAMILIES, write_checkpoint, write_gguf

pytestmark = pytest.mark.engine

Q = gguf.GGMLQuantizationType
LLAMA = next(f for f in FAMILIES if f.name == "mistral")   # LlamaForCausalLM's layers under another name
HEADER = ["", "tokens/s (median)", "vs llama.cpp", "weights read per token", "of its read limit"]
RATE = 50.0   # the llama.cpp stand-in's tokens/s


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    root = tmp_path_factory.mktemp("single")
    hf = write_checkpoint(LLAMA, root / "hf")
    types = {"token_embd.weight": Q.Q8_0, "output.weight": Q.Q8_0}
    for i in range(LLAMA.config["num_hidden_layers"]):
        types.update({f"blk.{i}.attn_{p}.weight": Q.Q8_0 for p in ("q", "k", "v", "output")})
        types.update({f"blk.{i}.ffn_{p}.weight": Q.Q4_1 for p in ("gate", "up", "down")})
    return write_gguf(hf, root / "tiny-q.gguf", "llama", types)


def _file_bytes(path) -> tuple[int, int]:
    """(bytes, float32 bytes) of what a token reads of the file: every tensor, of token_embd one row (the file has
    its own output.weight). Counted from the tensors' shapes and types, apart from the bench's code."""
    shipped = dequantized = 0
    for t in gguf.GGUFReader(str(path)).tensors:
        elements = int(np.prod([int(d) for d in t.shape]))
        block, size = gguf.GGML_QUANT_SIZES[t.tensor_type]
        nbytes = elements // block * size
        if t.name == "token_embd.weight":
            rows = int(t.shape[1])
            nbytes, elements = nbytes // rows, elements // rows
        shipped, dequantized = shipped + nbytes, dequantized + 4 * elements
    return shipped, dequantized


def _mb(cell: str) -> float:
    return float(cell.removesuffix(" MB"))


class _FakeLlama:
    """llama.cpp's stand-in: the tokens 7, 8, ... at RATE tokens/s exactly."""
    version = "0.0-test"

    def run(self, prompt, n):
        return list(range(7, 7 + n)), [i / RATE for i in range(n)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("llama", [False, True], ids=["no-llama.cpp", "llama.cpp-stand-in"])
def test_single_stream_table_is_computed_from_its_rows(capsys, monkeypatch, path, llama):
    if llama:
        monkeypatch.setattr(single_stream.LlamaCpp, "load", classmethod(lambda cls, *a: _FakeLlama()))
    argv = ["bench", "single-stream", "--model", str(path), "--output-len", "4", "--prompt-len", "5", "--rounds", "2",
            "--bandwidth-mib", "64", "--markdown"] + ([] if llama else ["--skip-llama-cpp"])
    rc, out, err = run_cli(capsys, argv)
    assert rc == 0, err
    bandwidth = float(re.search(r"^memory read: (\d+\.\d\d) GB/s \(2 threads summing 64 MiB", out, re.M)[1]) * 1e9
    assert re.search(MACHINE, out, re.M), out
    rows = parse_table(out, HEADER)
    names = ["devharness, as shipped (Q4_1, Q8_0 blocks)", "devharness `--dequantize` (float32)"] + \
        ["llama.cpp (llama-cpp-python 0.0-test, 2 threads)"] * llama
    assert [r[0] for r in rows[:len(names)]] == names, rows
    shipped, dequantized = _file_bytes(path)
    want_mb = [shipped / 1e6, dequantized / 1e6] + [shipped / 1e6] * llama
    assert [_mb(r[3]) for r in rows[:len(names)]] == pytest.approx(want_mb, rel=1e-3), (rows, want_mb)
    limits = rows[len(names):]
    assert [r[0] for r in limits] == [f"memory-read limit, {r[3]} a token at {bandwidth / 1e9:.2f} GB/s"
                                      for r in rows[:2]], limits
    for row in rows:
        tps, cap = float(row[1]), bandwidth / (_mb(row[3]) * 1e6)
        assert float(row[4].removesuffix("%")) == pytest.approx(100 * tps / cap, abs=0.6 + 0.02 * 100 * tps / cap), row
    for row in limits:   # the limit is the bandwidth over the bytes
        assert float(row[1]) == pytest.approx(bandwidth / (_mb(row[3]) * 1e6), rel=0.005, abs=0.051), row
    if llama:
        assert float(rows[2][1]) == RATE and times(rows[2][2]) == 1.0, rows
        for row in rows:   # every row, limits included, against llama.cpp's measured tokens/s
            assert times(row[2]) == pytest.approx(float(row[1]) / RATE, abs=0.006), row
        assert "not installed" not in out
        # The text table says the same ratios; the tokens are compared with llama.cpp's.
        for name in ("devharness, as shipped", "devharness --dequantize"):
            m = re.search(rf"^  {re.escape(name)}\s+([\d.]+)\s+[\d.]+\s+[\d.]+\s+(\d+\.\d+)x", out, re.M)
            assert m and float(m[2]) == pytest.approx(float(m[1]) / RATE, abs=0.002), out
            assert re.search(rf"{re.escape(name)}: its greedy tokens equal llama.cpp's for the first \d of 4", out)
    else:
        assert all(r[2] == "" for r in rows), rows
        assert out.rstrip().endswith("llama.cpp: left out (--skip-llama-cpp)."), out


def test_llama_cpp_missing_is_said(capsys, monkeypatch):
    """Without llama-cpp-python the bench says how to get it, and the table says so too."""
    import builtins
    real_import = builtins.__import__

    def no_llama(name, *args, **kw):
        if name == "llama_cpp":
            raise ImportError("No module named 'llama_cpp'")
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_llama)
    assert single_stream.LlamaCpp.load("x.gguf", 2, 64) is None
    case = single_stream.Case("devharness, as shipped", 100_000_000, [40.0, 50.0, 45.0])
    blocks = single_stream.markdown_blocks([case], 10e9, note=single_stream.NOT_INSTALLED)
    assert blocks[0].rows == [["devharness, as shipped", "45.0", "", "100 MB", "45%"],
                              ["memory-read limit, 100 MB a token at 10.00 GB/s", "100.0", "", "100 MB", "100%"]]
    assert blocks[1] == "llama.cpp: not installed (pip install devharness[llama], or --llama-bench PATH)."


STAND_IN = '''#!{python}
import json, sys
args = sys.argv[1:]
open({log!r}, "a").write(json.dumps(args) + "\\n")
n = int(args[args.index("-n") + 1])
print(json.dumps([{{"build_commit": "abc1234", "n_gen": n, "avg_ts": {rate}}}]))
'''


@pytest.mark.timeout(300)
def test_llama_bench_gives_llama_cpp_its_row(capsys, path, tmp_path):
    # llama.cpp's own benchmark program, here a stand-in that logs how it was called and reports RATE tokens/s.
    import json
    import sys
    log, program = tmp_path / "calls.jsonl", tmp_path / "llama-bench"
    program.write_text(STAND_IN.format(python=sys.executable, log=str(log), rate=RATE))
    program.chmod(0o755)
    argv = ["bench", "single-stream", "--model", str(path), "--output-len", "6", "--prompt-len", "5", "--rounds", "2",
            "--bandwidth-mib", "64", "--markdown", "--llama-bench", str(program)]
    rc, out, err = run_cli(capsys, argv)
    assert rc == 0, err
    rows = parse_table(out, HEADER)
    llama = next(r for r in rows if r[0].startswith("llama.cpp"))
    assert llama[0] == "llama.cpp (llama-bench build abc1234, 2 threads)" and float(llama[1]) == RATE, rows
    shipped = next(r for r in rows if r[0].startswith("devharness, as shipped"))
    # vs llama.cpp, from the two rows' own rates
    assert float(shipped[2].rstrip("×")) == pytest.approx(float(shipped[1]) / RATE, rel=0.01), shipped
    limits = [r[0] for r in rows if r[0].startswith("memory-read limit")]
    assert len(limits) == len(set(limits)) == 2, limits   # as shipped (llama.cpp reads the same) and float32
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 3   # a warm-up and one a round
    for call in calls:   # the same file, threads, 5 generated after a context of the prompt and the first token
        got = dict(zip(call[0::2], call[1::2]))
        assert got["-m"] == str(path), call
        assert (got["-t"], got["-p"], got["-d"], got["-n"], got["-o"]) == ("2", "0", "6", "5", "json"), call
    assert "greedy tokens equal llama.cpp's" not in out   # llama-bench prints no tokens to compare
