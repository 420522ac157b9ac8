"""`devharness serve|tui|generate|bench|check`. A user error prints one line and exits 2."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from devharness.config import EXECUTOR_BACKENDS, RAY_CONTROL_PLANES


class UsageError(Exception):
    """A bad argument from the user: one line, exit 2, no traceback."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def _ranks(text: str) -> list[int]:
    try:
        return sorted({int(r) for r in text.split(",") if r.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--debug-wait expects comma-separated ranks like 0,1, not {text!r}") from None


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-llama", help="tiny-llama, smollm2, a Hugging Face directory or a .gguf file")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    p.add_argument("--executor", choices=EXECUTOR_BACKENDS, default=None,
                   help="uni (in process), mp (processes) or ray (actors); default uni at tp=pp=1, else mp")
    p.add_argument("--ray-control-plane", choices=RAY_CONTROL_PLANES, default="shm")
    p.add_argument("--ray-address", default=None,
                   help="join this Ray cluster, shipping the devharness package with the job "
                        "(default: $RAY_ADDRESS, else a private local Ray instance)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")


def add_debug_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--debug", action="store_true", help="debugpy in every worker, /debug routes, long timeouts")
    p.add_argument("--debug-host", default="127.0.0.1",
                   help="where debug listeners bind; anything but loopback lets others run code in the workers")
    p.add_argument("--debug-port-base", type=int, default=5678, help="rank r listens on base + r")
    p.add_argument("--debug-wait", type=_ranks, default=[], metavar="RANKS",
                   help="comma-separated ranks that wait for a debugger before their first step")


def llm_kwargs(args) -> dict:
    from devharness.config import DebugConfig
    kw = dict(model=args.model, tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp,
              distributed_executor_backend=args.executor, dtype=args.dtype, max_model_len=args.max_model_len,
              seed=args.seed, device=args.device, max_num_seqs=args.max_num_seqs,
              ray_control_plane=args.ray_control_plane, ray_address=args.ray_address)
    if getattr(args, "debug", False):
        kw["debug"] = DebugConfig(enabled=True, host=args.debug_host, port_base=args.debug_port_base,
                                  wait_ranks=args.debug_wait)
    return kw


def cmd_generate(args) -> int:
    from devharness import LLM, SamplingParams
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sampling_seed, ignore_eos=args.ignore_eos)
    with LLM(**llm_kwargs(args)) as llm:
        prompts = args.prompt
        if args.chat:
            tok = llm.tokenizer
            prompts = [{"prompt_token_ids": tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]),
                                                       add_special_tokens=False), "prompt": p} for p in prompts]
        outs = llm.generate(prompts, params)
    for o in outs:
        c = o.outputs[0]
        if args.json:
            print(json.dumps({"prompt": o.prompt, "prompt_token_ids": o.prompt_token_ids, "token_ids": c.token_ids,
                              "text": c.text, "finish_reason": c.finish_reason}))
        else:
            print(f"{o.prompt!r} -> {c.text!r}  [{len(c.token_ids)} tokens, {c.finish_reason}]")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="devharness", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text for one or more prompts")
    add_engine_args(g)
    g.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    g.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt: token ids and text")
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="OpenAI-compatible server (add --debug for the debug API)")
    add_engine_args(s)
    add_debug_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.set_defaults(func=lambda a: __import__("devharness.server.app", fromlist=["serve_main"]).serve_main(a))

    t = sub.add_parser("tui", help="live view of a `devharness serve --debug` server")
    t.add_argument("--url", default="http://127.0.0.1:8000")
    t.set_defaults(func=lambda a: __import__("devharness.tui.app", fromlist=["tui_main"]).tui_main(a))

    b = sub.add_parser("bench", help="benchmarks, measured side by side in one run")
    bsub = b.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    from devharness.bench import register_benchmarks
    register_benchmarks(bsub, add_engine_args)

    c = sub.add_parser("check", help="compare a tp x pp layout with tp=1, pp=1, layer by layer")
    add_engine_args(c)
    c.add_argument("--prompt", default="The capital of France is")
    c.add_argument("--tolerance", type=float, default=None,
                   help="largest relative difference per layer (default 1e-4 in float32, 3e-2 otherwise)")
    c.set_defaults(func=lambda a: __import__("devharness.debug.check", fromlist=["check_main"]).check_main(a))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as e:
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
