"""`devharness serve|tui|generate|replay|bundle|kv|requests|collectives|trace|bench|check`. A user error prints one
line and exits 2."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from devharness.config import KERNEL_BACKENDS, MAX_PENDING_REQUESTS, SERVER_PORT, positive_int
from devharness.engine.args import EngineArgs, add_option_flags, check_option_flags

SERVER_URL = f"http://127.0.0.1:{SERVER_PORT}"   # where a `devharness serve` with default flags is reached


class UsageError(Exception):
    """A bad argument from the user: one line, exit 2, no traceback."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def _token(text: str) -> str:
    """A Bearer token (--api-key, --debug-token, --token): printable ASCII without spaces."""
    if not text or not all(33 <= ord(c) < 127 for c in text):
        raise argparse.ArgumentTypeError("must be a non-empty string of printable ASCII characters without spaces")
    return text


# Flags whose value is a token: a value that starts with '-' is still theirs (below, _join_token_values).
TOKEN_FLAGS = ("--token", "--api-key", "--debug-token")


def _join_token_values(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`--token -x…` as `--token=-x…`, for TOKEN_FLAGS only: argparse takes any argument that starts with '-' for a
    flag and says 'expected one argument', though a token may start with one. Not when the next argument is one of
    the parser's own flags (a value left out): argparse then names the flag that lacks it."""
    known = _option_strings(parser)
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":   # what follows is positional
            return out + argv[i:]
        value = argv[i + 1] if i + 1 < len(argv) else None
        if arg in TOKEN_FLAGS and value is not None and value.startswith("-") \
                and value.split("=", 1)[0] not in known:
            out.append(f"{arg}={value}")
            i += 2
        else:
            out.append(arg)
            i += 1
    return out


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """Every flag of `parser` and of its subcommands, at any depth."""
    found = set()
    for action in parser._actions:
        found.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _option_strings(sub)
    return found


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line as main() reads it (a token flag's value may start with '-')."""
    parser = build_parser()
    return parser.parse_args(_join_token_values(sys.argv[1:] if argv is None else list(argv), parser))


def _add_token_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token", type=_token, default=os.environ.get("DEVHARNESS_DEBUG_TOKEN") or None,
                   help="the server's debug token, sent as 'Authorization: Bearer' (default: $DEVHARNESS_DEBUG_TOKEN)")


def cmd_generate(args) -> int:
    from devharness.sampling_params import SamplingParams
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sampling_seed, ignore_eos=args.ignore_eos)
    prompts = list(args.prompt or [])
    if args.prompts_file:
        try:
            with open(args.prompts_file, encoding="utf-8") as f:
                prompts = [line.rstrip("\n") for line in f if line.strip()] + prompts
        except OSError as e:
            raise UsageError(f"--prompts-file: {e.strerror}: {args.prompts_file}") from None
    if not prompts:
        raise UsageError("generate needs --prompt or --prompts-file")
    if args.trace and not os.path.isdir(os.path.dirname(os.path.abspath(args.trace))):
        raise UsageError(f"--trace {args.trace}: no such directory")   # before the model loads
    if args.torch and not args.trace:
        raise UsageError("--torch merges torch.profiler's events into --trace's file: pass --trace FILE too")
    engine_args = EngineArgs.from_cli_args(args)
    engine_args.create_engine_config()   # a bad value is named here, before torch is even imported
    from devharness import LLM
    from devharness.protocol.errors import NonFiniteError
    failed = None
    with LLM(**engine_args.kwargs()) as llm:
        if args.chat:
            tok = llm.tokenizer
            prompts = [{"prompt_token_ids": tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]),
                                                       add_special_tokens=False), "prompt": p} for p in prompts]
        if args.trace and args.torch:   # one torch.profiler trace per rank around the run, merged below
            import tempfile
            profiles = tempfile.TemporaryDirectory(prefix="devharness-trace-")
            llm.start_profile("torch", profiles.name)
        try:
            outs = llm.generate(prompts, params)
        except NonFiniteError as e:   # the other prompts' outputs are printed; the error names where it was born
            outs, failed = e.outputs, e
        if args.trace:   # the run's steps, as the ranks' histories hold them
            from devharness.diagnostics import timeline
            from devharness.monitor import trace
            torch_traces = ({r.rank: r.trace for r in llm.stop_profile()} if args.torch else None)
            doc = trace.write(trace.read_engine(llm.engine), args.trace, torch_traces=torch_traces)
            if args.torch:
                profiles.cleanup()
            print(timeline.render(doc["otherData"]["answers"]) + f"trace: wrote {args.trace}", file=sys.stderr)
    for o in outs:
        c = o.outputs[0]
        if args.json:
            print(json.dumps({"prompt": o.prompt, "prompt_token_ids": o.prompt_token_ids, "token_ids": c.token_ids,
                              "text": c.text, "finish_reason": c.finish_reason}))
        else:
            print(f"{o.prompt!r} -> {c.text!r}  [{len(c.token_ids)} tokens, {c.finish_reason}]")
    if failed is not None:
        print(f"devharness: error: {failed}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="devharness", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text for one or more prompts")
    EngineArgs.add_cli_args(g, record=True)
    g.add_argument("--prompt", action="append", help="repeat for several prompts")
    g.add_argument("--prompts-file", metavar="F", help="one prompt per line (before any --prompt)")
    g.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt: token ids and text")
    g.add_argument("--trace", metavar="FILE", default=None,
                   help="write the run's timeline (devharness trace's file) here; where its time went on stderr")
    g.add_argument("--torch", action="store_true",
                   help="with --trace: profile the run with torch.profiler and merge each rank's ops under it")
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="OpenAI-compatible server (add --debug for the debug API)")
    EngineArgs.add_cli_args(s, debug=True, record=True, restart=True)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=SERVER_PORT)
    s.add_argument("--api-key", type=_token, default=os.environ.get("DEVHARNESS_API_KEY") or None, metavar="KEY",
                   help="/v1 needs 'Authorization: Bearer KEY' (default: $DEVHARNESS_API_KEY; none: open)")
    s.add_argument("--debug-token", type=_token, default=os.environ.get("DEVHARNESS_DEBUG_TOKEN") or None, metavar="T",
                   help="/debug needs 'Authorization: Bearer T' (default: $DEVHARNESS_DEBUG_TOKEN); off loopback "
                        "a token is always needed, and one is made and printed if none is given")
    s.add_argument("--max-pending-requests", type=positive_int, default=MAX_PENDING_REQUESTS, metavar="N",
                   help="unfinished choices the server holds (a request counts n times its prompts); a request "
                        "past it gets 429 with Retry-After, one of more than N choices 400 (default %(default)s)")
    s.set_defaults(func=lambda a: __import__("devharness.server.app", fromlist=["serve_main"]).serve_main(a))

    t = sub.add_parser("tui", help="live view of a `devharness serve --debug` server")
    t.add_argument("--url", default=SERVER_URL)
    _add_token_args(t)
    t.add_argument("--api-key", type=_token, default=os.environ.get("DEVHARNESS_API_KEY") or None, metavar="KEY",
                   help="the server's --api-key, for the completions the TUI sends (default: $DEVHARNESS_API_KEY)")
    t.set_defaults(func=lambda a: __import__("devharness.tui.app", fromlist=["tui_main"]).tui_main(a))

    r = sub.add_parser("replay", help="run a recording's steps again and compare every sampled token")
    r.add_argument("directory", help="a directory written by --record, or a bundle")
    # The engine's own flags, each default None: the recording's.
    recorded = ["tensor_parallel_size", "pipeline_parallel_size", "distributed_executor_backend", "model",
                "threads_per_worker", "inject", "kernels"]
    add_option_flags(r, recorded, defaults=dict.fromkeys(recorded), notes={
        **dict.fromkeys(recorded, "default here: the recording's"),
        "model": "default here: the recording's (another model is refused)",
        "inject": "default here: the recording's own (devharness/debug/faults.py lists them)",
        "kernels": "default here: the recording's (the verdict says when it differs)"})
    r.add_argument("--json", action="store_true", help="the verdict as one JSON object")
    from devharness.monitor import replay_cli
    replay_cli.add_cli_args(r)
    r.set_defaults(func=replay_cli.replay_main)

    u = sub.add_parser("bundle", help="ask a `serve --debug` server to write a bundle (recent steps, states, stacks)")
    u.add_argument("--url", default=SERVER_URL)
    u.add_argument("--out", metavar="DIR", default=None, help="also fetch the bundle into DIR")
    _add_token_args(u)
    u.set_defaults(func=lambda a: __import__("devharness.monitor.bundle_client",
                                             fromlist=["bundle_main"]).bundle_main(a))

    k = sub.add_parser("kv", help="the KV cache map of a `serve --debug` server: blocks, tables, recent events")
    k.add_argument("--url", default=SERVER_URL)
    k.add_argument("--events", type=int, default=20, metavar="N", help="the last N events (0: none)")
    k.add_argument("--json", action="store_true", help="the server's GET /debug/kv answer as it came")
    _add_token_args(k)
    k.set_defaults(func=lambda a: __import__("devharness.monitor.kv", fromlist=["kv_main"]).kv_main(a))

    rq = sub.add_parser("requests", help="why each request of a `serve --debug` server waits, the stalls seen, or one "
                                         "request's story")
    rq.add_argument("request_id", nargs="?", metavar="ID", help="one request: its story (default: every request)")
    rq.add_argument("--url", default=SERVER_URL)
    rq.add_argument("--json", action="store_true", help="the server's GET /debug/requests[/ID] answer as it came")
    _add_token_args(rq)
    rq.set_defaults(func=lambda a: __import__("devharness.monitor.requests_view",
                                              fromlist=["requests_main"]).requests_main(a))

    cl = sub.add_parser("collectives", help="the ranks' collective ledgers side by side, from a bundle or a server")
    cl.add_argument("bundle", nargs="?", metavar="BUNDLE", help="a bundle directory")
    cl.add_argument("--url", default=None, help="a `serve --debug` server instead of a bundle")
    cl.add_argument("--rows", type=positive_int, default=12, metavar="N",
                    help="the last N sequence numbers of each group (the first disagreement is always shown)")
    _add_token_args(cl)
    cl.set_defaults(func=lambda a: __import__("devharness.monitor.collectives_view",
                                              fromlist=["collectives_main"]).collectives_main(a))

    tr = sub.add_parser("trace", help="one timeline of every rank for Perfetto (Chrome Trace Event Format) and where "
                                      "the time went: stage bubbles, collective skew, the straggler")
    tr.add_argument("bundle", nargs="?", metavar="BUNDLE", help="a bundle directory")
    tr.add_argument("--url", default=None, help="a `serve --debug` server instead of a bundle")
    tr.add_argument("--steps", type=positive_int, default=None, metavar="N",
                    help="the last N steps (default: all the ranks' histories hold)")
    tr.add_argument("--out", metavar="FILE", required=True, help="write the trace here (JSON)")
    tr.add_argument("--json", action="store_true", help="print the answers as one JSON object")
    tr.add_argument("--torch", metavar="DIR", default=None,
                    help="merge each rank's torch.profiler trace found in DIR (POST /debug/profile/start's) under it")
    _add_token_args(tr)
    tr.set_defaults(func=lambda a: __import__("devharness.monitor.trace", fromlist=["trace_main"]).trace_main(a))

    b = sub.add_parser("bench", help="benchmarks, measured side by side in one run")
    bsub = b.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    from devharness.bench import register_benchmarks
    register_benchmarks(bsub)

    c = sub.add_parser("check", help="what changes the answer: a tp x pp layout against tp=1 (site by site), a "
                                     "kernel backend against another (--against), the batch (--batch-invariance), or "
                                     "the prefix cache (--prefix-cache)")
    EngineArgs.add_cli_args(c)
    c.add_argument("--prompt", default=None,
                   help="the prompt checked (the probe; default \"The capital of France is\", shortened where the "
                        "model's context is shorter)")
    c.add_argument("--against", choices=KERNEL_BACKENDS, default=None, metavar="BACKEND",
                   help="compare the --kernels backend with this one on the same layout, op by op")
    c.add_argument("--batch-invariance", action="store_true",
                   help="run the prompt alone and inside a batch of others; exit 1 where its numbers differ")
    c.add_argument("--prefix-cache", action="store_true",
                   help="compute the prompt cold and with its first blocks from the prefix cache, on one layout; "
                        "exit 1 where any layer, site or logit differs (bit for bit)")
    c.add_argument("--tolerance", type=float, default=None,
                   help="largest relative difference per site or op (default 1e-4 in float32, 3e-2 otherwise; "
                        "--batch-invariance: 0, bit for bit)")
    c.add_argument("--decode-steps", type=int, default=None, metavar="N",
                   help="decode steps compared after the prefill (default 4, fewer where the model's context is "
                        "shorter)")
    c.add_argument("--json", action="store_true", help="the verdict and the first divergence as one JSON object")
    c.add_argument("--table", action="store_true",
                   help="every step's, layer's, site's (and op's) difference before the verdict")
    c.set_defaults(func=lambda a: __import__("devharness.monitor.check_cli", fromlist=["check_main"]).check_main(a))
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        if getattr(args, "precheck", None):
            args.precheck(args)    # a command's own reading of its flags, where it says more than the configs would
        check_option_flags(args)   # the engine options' values, held to their configs' checks
    except (UsageError, ValueError) as e:
        print(f"devharness: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args) or 0
    except (ValueError, UsageError) as e:
        print(f"devharness: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
