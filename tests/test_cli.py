"""The command line: generate (text and --json), and one-line errors with exit status 2."""
import argparse
import json
import subprocess
import sys

import pytest

from devharness import LLM, SamplingParams
from devharness.cli import main


def test_generate_json_gives_token_ids_and_text(capsys):
    assert main(["generate", "--model", "tiny-llama", "--prompt", "Hello", "--prompt", "World",
                 "--max-tokens", "6", "--ignore-eos", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    with LLM("tiny-llama") as llm:
        ref = llm.generate(["Hello", "World"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert [r["token_ids"] for r in rows] == [o.outputs[0].token_ids for o in ref]
    assert [r["text"] for r in rows] == [o.outputs[0].text for o in ref]
    assert rows[0]["prompt"] == "Hello" and rows[0]["finish_reason"] == "length"


@pytest.mark.parametrize("argv, words", [
    (["generate", "--model", "tiny-llama"], "--prompt"),
    (["generate", "--model", "nope", "--prompt", "x"], "unknown model 'nope'"),
    (["generate", "--prompt", "x", "--max-tokens", "0"], "max_tokens"),
    (["generate", "--prompt", "x", "--tp", "3", "--executor", "mp"], "tensor_parallel_size=3"),
    (["generate", "--prompt", "x", "--temperature", "hot"], "--temperature"),
    (["serve", "--debug-wait", "one"], "--debug-wait"),
    (["frobnicate"], "invalid choice"),
    (["bundle", "--url", "http://127.0.0.1:9"], "ConnectError"),
    (["generate", "--prompt", "x", "--flight-steps", "-1"], "flight_steps"),
])
def test_user_errors_are_one_line_exit_2(argv, words):
    res = subprocess.run([sys.executable, "-m", "devharness.cli", *argv], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("devharness: error:") and words in lines[0], res.stderr


@pytest.mark.parametrize("argv, words", [
    (["serve", "--max-pending-requests", "0"], "--max-pending-requests"),
    (["serve", "--max-pending-requests", "many"], "--max-pending-requests"),
    (["serve", "--api-key", ""], "--api-key"),
    (["serve", "--debug-token", "caf\u00e9"], "--debug-token"),
    (["tui", "--token", "two words"], "--token"),
    (["bundle", "--token", ""], "--token"),
    (["serve", "--port", "0", "--restart-workers", "--max-worker-restarts", "0"], "max_worker_restarts"),
    (["generate", "--prompt", "x", "--kernels", "foo"], "--kernels: invalid choice: 'foo'"),
    (["serve", "--kernels", "native"], "--kernels: invalid choice: 'native'"),
    (["check", "--kernels", "eager"], "--kernels: invalid choice: 'eager'"),
    # The engine options' flags on commands of their own are held to the configs' checks as well, naming the flag.
    (["replay", "/no/such/recording", "--tp", "0"], "argument --tp: ParallelConfig.tensor_parallel_size=0: must be"),
    (["replay", "/no/such/recording", "--inject", "stall:rank=1"], "argument --inject: EngineConfig.inject="),
    (["bench", "executor", "--threads-per-worker", "0"], "argument --threads-per-worker: ParallelConfig.threads_per"),
    (["bench", "kernels", "--model", ""], "argument --model: ModelConfig.model=''"),
    (["serve", "--inject", "kv-leak"], "argument --inject: EngineConfig.inject='kv-leak': kv-leak needs step="),
    (["serve", "--otlp-traces-endpoint", "localhost:4318"], "argument --otlp-traces-endpoint: EngineConfig.otlp_"),
    (["serve", "--otlp-traces-endpoint", "http://127.0.0.1:99999/v1/traces"], "must be an http:// or https:// URL"),
    (["generate", "--prompt", "x", "--otlp-traces-endpoint", "http:///v1/traces"], "--otlp-traces-endpoint"),
    (["serve", "--otlp-traces-endpoint", "http://127.0.0.1:4318", "--no-request-stories"],
     "needs SchedulerConfig.request_stories on"),
])
def test_bad_auth_and_limit_flags_are_one_line_exit_2(argv, words, capsys):
    # In process (they fail while parsing, before anything starts): the subprocess cases above cost seconds each.
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("devharness: error:") and words in err, err


@pytest.mark.parametrize("argv, words", [
    (["generate", "--prompt", "x", "--device", "gpu"], "ModelConfig.device='gpu': must be cpu, cuda or cuda:N"),
    (["generate", "--prompt", "x", "--device", "cuda:99"], "device 'cuda:99'"),   # no machine here has a 100th GPU
    (["generate", "--prompt", "x", "--device", "cuda:1", "--tp", "2", "--executor", "mp"], "names one GPU"),
    (["generate", "--prompt", "x", "--max-num-batched-tokens", "0"], "SchedulerConfig.max_num_batched_tokens=0"),
])
def test_bad_device_is_one_line_exit_2(argv, words, capsys):
    # In process: each fails before a worker starts (the device is checked where the workers will run).
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("devharness: error:") and words in err, err


def test_auth_and_limit_flags_parse_and_everything_binds_loopback_by_default(monkeypatch):
    from devharness.cli import build_parser
    from devharness.config import DebugConfig
    a = build_parser().parse_args(["serve", "--debug"])
    assert a.host == a.debug_host == DebugConfig().host == "127.0.0.1"
    monkeypatch.setenv("DEVHARNESS_DEBUG_TOKEN", "from-env")
    monkeypatch.setenv("DEVHARNESS_API_KEY", "")   # empty: as if unset
    a = build_parser().parse_args(["serve", "--api-key", "k1", "--max-pending-requests", "5"])
    assert (a.api_key, a.debug_token, a.max_pending_requests) == ("k1", "from-env", 5)
    a = build_parser().parse_args(["serve", "--debug-token", "t1"])
    assert (a.api_key, a.debug_token, a.max_pending_requests) == (None, "t1", 1024)
    assert build_parser().parse_args(["tui", "--token", "t2"]).token == "t2"
    assert build_parser().parse_args(["bundle"]).token == "from-env"


def test_a_token_flag_takes_a_value_that_starts_with_a_dash(monkeypatch):
    # One generated token in 64 used to start with '-' (URL-safe base64), and `bundle --token <it>` failed to parse.
    from devharness.cli import TOKEN_FLAGS, _token, build_parser, parse_args
    monkeypatch.delenv("DEVHARNESS_DEBUG_TOKEN", raising=False)
    for command in ("bundle", "kv", "collectives", "tui"):
        assert parse_args([command, "--token", "-abc_DEF", "--url", "http://x"]).token == "-abc_DEF"
        assert parse_args([command, "--token=--abc"]).token == "--abc"
    a = parse_args(["tui", "--api-key", "-xyz", "--token", "-t"])
    assert (a.api_key, a.token) == ("-xyz", "-t")
    a = parse_args(["serve", "--api-key", "-xyz", "--debug-token", "-dt", "--port", "0"])
    assert (a.api_key, a.debug_token, a.port) == ("-xyz", "-dt", 0)
    assert parse_args(["-v", "serve", "--api-key", "--9"]).api_key == "--9"
    # Every flag that takes a token is one of TOKEN_FLAGS (a new one would not get the dash rule).
    def token_flags(parser):
        for action in parser._actions:
            if action.type is _token:
                yield from action.option_strings
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from token_flags(sub)
    assert set(token_flags(build_parser())) == set(TOKEN_FLAGS)


@pytest.mark.parametrize("argv, words", [
    (["bundle", "--token"], "argument --token: expected one argument"),
    (["bundle", "--token", "--url", "http://x"], "argument --token: expected one argument"),   # a value left out
    (["serve", "--api-key", "--debug"], "argument --api-key: expected one argument"),
    (["tui", "--token", "-two words"], "argument --token: must be"),
])
def test_a_token_flag_without_its_value_is_still_named(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and words in err, err


def test_scheduler_flags_reach_the_engine_config():
    from devharness.cli import build_parser
    from devharness.engine.args import EngineArgs
    ns = build_parser().parse_args(["generate", "--prompt", "x", "--max-num-seqs", "7",
                                    "--max-num-batched-tokens", "96"])
    sc = EngineArgs.from_cli_args(ns).create_engine_config().scheduler
    assert (sc.max_num_seqs, sc.max_num_batched_tokens) == (7, 96)
    ns = build_parser().parse_args(["generate", "--prompt", "x"])
    assert EngineArgs.from_cli_args(ns).create_engine_config().scheduler.max_num_batched_tokens == \
        EngineArgs().max_num_batched_tokens
