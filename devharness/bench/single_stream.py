"""`devharness bench single-stream`: one greedy request's decode speed (uni executor, tp=1, a few torch threads), the
model's weights as shipped (a GGUF file's blocks) and `--dequantize`d, beside llama.cpp on the same file (through
llama-cpp-python, where it is installed, or llama.cpp's own `llama-bench` program, `--llama-bench PATH`) and beside
the machine's memory-read limit: a decode step reads every weight once, so no engine decodes one stream faster than
the read bandwidth (measured here, on as many threads) over the bytes of weights a token reads. Cases take turns,
round by round in a rotating order, so that load from the other tenants of a small machine hits all of them alike.

Decode tokens/s: the tokens after the first over the time from the first to the last (the prompt's prefill and the
first token apart), the same in every case.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from devharness.bench.executor import positive_int
from devharness.bench.markdown import Table, add_flag, print_section, ratio

SHIPPED, DEQUANTIZED, LLAMA_CPP = "devharness, as shipped", "devharness --dequantize", "llama.cpp"
NOT_INSTALLED = "llama.cpp: not installed (pip install devharness[llama], or --llama-bench PATH)"


def register(sub) -> None:
    from devharness.engine.args import EngineArgs
    p = sub.add_parser("single-stream", help="one greedy stream's tokens/s: as shipped, --dequantize, llama.cpp "
                                             "and the memory-read limit")
    EngineArgs.add_cli_args(p)
    p.set_defaults(model="smollm2", func=run, threads_per_worker=2)
    p.add_argument("--output-len", type=positive_int, default=128, help="tokens generated per run")
    p.add_argument("--prompt-len", type=positive_int, default=16, help="tokens of the prompt")
    p.add_argument("--rounds", type=positive_int, default=3, help="runs of each case, by turns")
    p.add_argument("--bandwidth-mib", type=positive_int, default=1024,
                   help="MiB summed to measure the memory-read bandwidth (far above the caches)")
    p.add_argument("--skip-llama-cpp", action="store_true", help="leave llama.cpp's row out")
    p.add_argument("--llama-bench", metavar="PATH", help="llama.cpp's row from this llama-bench program (a build of "
                                                         "llama.cpp) instead of llama-cpp-python")
    add_flag(p)


@dataclass
class Case:
    """One row: its decode tokens/s per round, the bytes of weights one token reads, its greedy tokens."""
    name: str
    weight_bytes: int
    tokens_per_s: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.tokens_per_s)


def decode_rate(stamps: list[float]) -> float:
    """Tokens/s after the first: `stamps` are the times each token came out."""
    if len(stamps) < 2:
        raise ValueError("a decode rate needs at least 2 tokens (--output-len 2)")
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def read_bandwidth(mib: int, repeats: int = 5) -> float:
    """Bytes/s torch reads summing a float32 buffer of `mib` MiB on this process's torch threads (best of repeats):
    what a decode step that streams its weights from memory can reach at most."""
    import torch
    x = torch.ones(mib * 2**20 // 4)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def model_bytes_per_token(model) -> int:
    """Bytes of weights a decode token reads from a (whole, tp=1) DecoderForCausalLM: all of them, but of the
    embedding table one row (the LM head, tied or not, is its own matrix, read whole)."""
    total, _ = model.weight_bytes()
    table = model.model.embed_tokens.weight
    return total - table.numel() * table.element_size() + table[0].numel() * table.element_size()


def gguf_bytes_per_token(path: str) -> int:
    """Bytes of weights a decode token reads from the GGUF file as it is (llama.cpp computes with its blocks): every
    tensor, but of token_embd one row, unless no output.weight is there (tied: the head reads token_embd whole)."""
    import gguf
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    total = sum(int(t.n_bytes) for t in tensors.values())
    embd = tensors.get("token_embd.weight")
    if embd is not None and "output.weight" in tensors:
        rows = int(embd.shape[-1])   # ggml's shape: columns first
        total -= int(embd.n_bytes) - int(embd.n_bytes) // rows
    return total


def run_devharness(llm, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """One greedy request stepped to its end: its tokens and when each came out."""
    from devharness import SamplingParams
    engine = llm.engine
    engine.add_request({"prompt_token_ids": prompt}, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    tokens, stamps = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            new = out.outputs[0].token_ids[len(tokens):]
            tokens += new
            stamps += [now] * len(new)
    return tokens, stamps


class LlamaCpp:
    """llama.cpp on a GGUF file through llama-cpp-python, greedy, on `threads` threads; None from load() where the
    package is not installed."""

    def __init__(self, llama, version: str):
        self.llama, self.version = llama, version

    @classmethod
    def load(cls, path: str, threads: int, n_ctx: int) -> "LlamaCpp | None":
        try:
            import llama_cpp
        except ImportError:
            return None
        llama = llama_cpp.Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                                n_gpu_layers=0, seed=0, verbose=False)
        return cls(llama, llama_cpp.__version__)

    def run(self, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
        tokens, stamps = [], []
        self.llama.reset()   # the prompt computed whole, as devharness's is
        for tok in self.llama.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            tokens.append(int(tok))
            stamps.append(time.perf_counter())
            if len(tokens) == n:
                break
        return tokens, stamps


class LlamaBench:
    """llama.cpp's own benchmark program on a GGUF file: each run() is one `llama-bench` of `n - 1` generated tokens
    after a context of the prompt and one token (its depth), the rate devharness's runs report (the tokens after the
    first). It prints no tokens: the row has a rate and no greedy tokens to compare."""

    def __init__(self, program: str, path: str, threads: int, prompt_len: int):
        self.argv = [self.find(program), "-m", path, "-t", str(threads), "-p", "0", "-d", str(prompt_len + 1),
                     "-r", "1", "-o", "json"]
        self.version = "?"

    @staticmethod
    def find(program: str) -> str:
        """The program's path; ValueError naming the flag where there is no such executable."""
        import os
        import shutil
        found = shutil.which(program) if os.sep not in program else program
        if found is None or not os.path.isfile(found) or not os.access(found, os.X_OK):
            raise ValueError(f"--llama-bench {program}: no such program (a llama.cpp build's bin/llama-bench)")
        return found

    def run(self, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
        import json
        import subprocess
        done = subprocess.run([*self.argv, "-n", str(n - 1)], capture_output=True, text=True, timeout=600)
        try:
            result = json.loads(done.stdout)[-1]
            rate = float(result["avg_ts"])
        except (ValueError, LookupError, TypeError):
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"llama-bench exited {done.returncode} without a result: {last}") from None
        self.version = f"llama-bench build {result.get('build_commit', '?')}"
        return [], [i / rate for i in range(n)]   # n stamps at its rate: decode_rate gives the rate back


def run(args) -> int:
    import random

    import torch
    from devharness import LLM
    from devharness.engine.args import EngineArgs
    if args.output_len < 2:
        raise ValueError("--output-len must be at least 2: the decode rate is the tokens after the first")
    if args.llama_bench and not args.skip_llama_cpp:
        LlamaBench.find(args.llama_bench)   # before the models load
    kw = EngineArgs.from_cli_args(args).kwargs()
    if kw["tensor_parallel_size"] * kw["pipeline_parallel_size"] != 1:
        raise ValueError("a single stream runs on one worker: --tp 1 --pp 1")
    kw["distributed_executor_backend"] = "uni"
    threads = args.threads_per_worker
    torch.set_num_threads(threads)
    with LLM(**{**kw, "dequantize": False}) as shipped_llm, LLM(**{**kw, "dequantize": True}) as deq_llm:
        src = shipped_llm.engine.source
        rng = random.Random(args.seed)
        prompt = [rng.randrange(100, src.arch.vocab_size) for _ in range(args.prompt_len)]
        llms = {SHIPPED: shipped_llm, DEQUANTIZED: deq_llm}
        cases = {name: Case(name, model_bytes_per_token(llm.engine.workers.model_in_process()))
                 for name, llm in llms.items()}
        _, kept = shipped_llm.engine.workers.model_in_process().weight_bytes()
        runners = {name: (lambda llm=llm: run_devharness(llm, prompt, args.output_len)) for name, llm in llms.items()}
        llama, note = None, None
        if args.skip_llama_cpp:
            note = "llama.cpp: left out (--skip-llama-cpp)"
        elif src.kind != "gguf":
            note = "llama.cpp: left out (the model is not a GGUF file)"
        else:
            llama = LlamaBench(args.llama_bench, src.path, threads, args.prompt_len) if args.llama_bench else \
                LlamaCpp.load(src.path, threads, args.prompt_len + args.output_len + 16)
            if llama is None:
                note = NOT_INSTALLED
            else:
                cases[LLAMA_CPP] = Case(LLAMA_CPP, gguf_bytes_per_token(src.path))
                runners[LLAMA_CPP] = lambda: llama.run(prompt, args.output_len)
        if note:
            print(note)
        print(f"single stream: model {src.name}, uni executor, tp=1, {threads} torch threads; prompt {args.prompt_len} "
              f"tokens, {args.output_len} generated greedy; {args.rounds} rounds, the cases by turns")
        for run_case in runners.values():   # warm-up: first-use kernel builds, caches
            run_case()
        names = list(runners)
        for r in range(args.rounds):
            for i in range(len(names)):
                case = cases[names[(r + i) % len(names)]]
                case.tokens, stamps = runners[case.name]()
                case.tokens_per_s.append(decode_rate(stamps))
    bandwidth = read_bandwidth(args.bandwidth_mib)
    version = ""
    if isinstance(llama, LlamaBench):
        version = f"{llama.version}, "   # "llama-bench build <commit>"
    elif llama is not None:
        version = f"llama-cpp-python {llama.version}, "
    labels = {SHIPPED: f"devharness, as shipped ({', '.join(kept) + ' blocks' if kept else 'no blocks kept'})",
              DEQUANTIZED: f"devharness `--dequantize` ({kw['dtype']})",
              LLAMA_CPP: f"llama.cpp ({version}{threads} threads)"}
    _report(list(cases.values()), bandwidth, args.bandwidth_mib, threads)
    if args.markdown:
        print_section(markdown_blocks(list(cases.values()), bandwidth, labels, note),
                      note=f"{src.name}, uni executor, tp=1, prompt {args.prompt_len} tokens, {args.output_len} "
                           f"generated, {args.rounds} rounds, memory read {bandwidth / 1e9:.2f} GB/s")
    return 0


def megabytes(n: int) -> str:
    """Bytes as the table writes them: 4 significant digits of MB (a tiny test model reads a tenth of one)."""
    return f"{n / 1e6:.4g} MB"


def limit(bandwidth: float, bytes_per_token: int) -> float:
    """Tokens/s a decode reading `bytes_per_token` at `bandwidth` bytes/s cannot pass."""
    return bandwidth / bytes_per_token


def _report(cases: list[Case], bandwidth: float, mib: int, threads: int) -> None:
    base = next((c for c in cases if c.name == LLAMA_CPP), None)
    print(f"memory read: {bandwidth / 1e9:.2f} GB/s ({threads} threads summing {mib} MiB, best of 5)")
    print(f"\n  {'case':<26}{'tokens/s':>10}{'min':>9}{'max':>9}{'vs llama.cpp':>14}{'MB/token':>10}"
          f"{'limit tok/s':>13}{'of limit':>10}")
    for c in cases:
        vs = f"{c.median / base.median:.3f}x" if base else "-"
        cap = limit(bandwidth, c.weight_bytes)
        print(f"  {c.name:<26}{c.median:10.1f}{min(c.tokens_per_s):9.1f}{max(c.tokens_per_s):9.1f}{vs:>14}"
              f"{c.weight_bytes / 1e6:10.1f}{cap:13.1f}{c.median / cap:10.1%}")
    if base and base.tokens:   # llama-bench prints no tokens
        for c in cases:
            if c is not base:
                same = next((i for i, (a, b) in enumerate(zip(c.tokens, base.tokens)) if a != b), len(c.tokens))
                print(f"  {c.name}: its greedy tokens equal llama.cpp's for the first {same} of {len(c.tokens)}")


def markdown_blocks(cases: list[Case], bandwidth: float, labels: dict[str, str] | None = None,
                    note: str | None = None) -> list:
    """docs/benchmarks.md's table: each case's median tokens/s, against llama.cpp's where it ran, the bytes of weights
    a token reads and the case's fraction of the read limit those bytes set; then the read limits as rows; then why
    llama.cpp's row is missing (`note`), where it is."""
    labels = labels or {}
    base = next((c for c in cases if c.name == LLAMA_CPP), None)

    def vs(tps: float) -> str:
        return ratio(tps / base.median) if base else ""

    rows = []
    for c in cases:
        cap = limit(bandwidth, c.weight_bytes)
        rows.append([labels.get(c.name, c.name), f"{c.median:.1f}", vs(c.median), megabytes(c.weight_bytes),
                     f"{c.median / cap:.0%}"])
    seen = set()
    for c in cases:   # one limit a size as the table writes it (two counts of one file may differ by a few bytes)
        if megabytes(c.weight_bytes) in seen:
            continue
        seen.add(megabytes(c.weight_bytes))
        cap = limit(bandwidth, c.weight_bytes)
        rows.append([f"memory-read limit, {megabytes(c.weight_bytes)} a token at {bandwidth / 1e9:.2f} GB/s",
                     f"{cap:.1f}", vs(cap), megabytes(c.weight_bytes), "100%"])
    blocks = [Table(["", "tokens/s (median)", "vs llama.cpp", "weights read per token", "of its read limit"], rows)]
    if note:
        blocks.append(note + ".")
    return blocks
