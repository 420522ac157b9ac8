"""An engine option is declared once, as a config field: EngineArgs, `LLM(...)`'s keywords, the CLI's flags (with
the field's help text) and docs/cli.md's rows are all made from the fields. A field added to a copy of a config
shows up in all of them; the real configs' options reach the engine config from the keywords and from the flags."""
import argparse
import re
from typing import Annotated

import msgspec
import pytest

import devharness.cli
import devharness.engine.llm
from devharness import LLM
from devharness.config import ConfigError, EngineConfig, Option, SchedulerConfig
import devharness.engine.args
from devharness.engine.args import (CONFIGS, EngineArgs, check_option_flags, engine_options, flag_table,
                                    make_engine_args)

HELP = "widgets a step may hold at most"


def widget_configs():
    sched = msgspec.defstruct("SchedulerConfig", [("max_widgets", Annotated[int, Option(HELP, metavar="N")], 7)],
                              bases=(SchedulerConfig,), kw_only=True)
    return dict(CONFIGS, scheduler=sched)


def test_a_field_added_to_a_config_is_an_engine_argument_a_flag_and_a_row():
    args_cls = make_engine_args(widget_configs())
    assert args_cls().max_widgets == 7
    assert args_cls.from_kwargs(max_widgets=9).create_engine_config().scheduler.max_widgets == 9

    parser = argparse.ArgumentParser()
    args_cls.add_cli_args(parser)
    text = " ".join(parser.format_help().split())
    assert "--max-widgets N" in text and HELP in text
    ns = parser.parse_args(["--max-widgets", "11", "--tp", "2"])
    config = args_cls.from_cli_args(ns).create_engine_config()
    assert (config.scheduler.max_widgets, config.parallel.tensor_parallel_size) == (11, 2)

    assert f"| `--max-widgets N` | engine | 7 | {HELP} |" in flag_table(widget_configs())
    # The real EngineArgs has no such field: the copy is what added it.
    with pytest.raises(ValueError, match="unknown engine argument.*max_widgets"):
        EngineArgs.from_kwargs(max_widgets=9)


def test_a_field_added_to_a_config_reaches_llm_and_the_commands(monkeypatch, capsys):
    args_cls = make_engine_args(widget_configs())
    monkeypatch.setattr(devharness.engine.llm, "EngineArgs", args_cls)
    with LLM("tiny-llama", max_widgets=5, num_kv_blocks=16) as llm:
        assert llm.config.scheduler.max_widgets == 5

    monkeypatch.setattr(devharness.cli, "EngineArgs", args_cls)
    parser = devharness.cli.build_parser()
    for command in ("generate", "serve", "check"):
        with pytest.raises(SystemExit):
            parser.parse_args([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "--max-widgets N" in text and HELP in text, command


def test_every_option_of_the_real_configs_round_trips_through_its_flag():
    """Each flag, given a value other than its default, lands in the field it is."""
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser, debug=True, record=True, restart=True)
    argv, expect = [], {}
    others = {int: 3, float: 2.5, str: None}
    for o in engine_options():
        kw = o.argparse_kwargs()
        if o.name == "batch_invariant":
            continue   # needs the fast kernels in float32, which this argv changes: round-tripped below
        if o.name == "request_stories":
            continue   # off refuses the --otlp-traces-endpoint this argv gives: round-tripped below
        if o.type is bool:
            argv.append(o.flag if not o.default else f"--no-{o.flag[2:]}")
            expect[(o.config, o.name)] = not o.default
        elif "type" not in kw:   # an optional switch (None: the engine decides): the flag says yes
            assert kw["action"] is argparse.BooleanOptionalAction and o.default is None
            argv.append(o.flag)
            expect[(o.config, o.name)] = True
        elif "choices" in kw:
            value = next(c for c in reversed(kw["choices"]) if c != o.default)
            argv += [o.flag, value]
            expect[(o.config, o.name)] = value
        elif o.name in ("pp_layer_partition", "wait_ranks"):
            argv += [o.flag, "2,1"]
            expect[(o.config, o.name)] = [2, 1] if o.name == "pp_layer_partition" else [1, 2]
        elif kw["type"] is str:
            value = {"model": "smollm2", "device": "cpu", "debug_host": "127.0.0.2",
                     "inject": "raise:step=5:rank=0",
                     "otlp_traces_endpoint": "http://127.0.0.1:4318/v1/traces"}.get(o.dest, f"/tmp/x-{o.name}")
            if o.name == "device":
                continue   # one valid value that is not its default would need a GPU
            argv += [o.flag, value]
            expect[(o.config, o.name)] = value
        else:
            value = others[kw["type"]] + (1 if o.default == others[kw["type"]] else 0)
            argv += [o.flag, str(value)]
            expect[(o.config, o.name)] = value
    argv += ["--pp", "2"]
    expect[("parallel", "pipeline_parallel_size")] = 2
    config = EngineArgs.from_cli_args(parser.parse_args(argv)).create_engine_config()
    assert isinstance(config, EngineConfig)
    for (where, name), value in expect.items():
        got = getattr(getattr(config, where) if where else config, name)
        assert got == value, f"{where}.{name}: {got!r} != {value!r} (argv {argv})"
    assert len(expect) >= 30
    alone = EngineArgs.from_cli_args(parser.parse_args(["--batch-invariant"])).create_engine_config()
    assert alone.model.batch_invariant is True
    alone = EngineArgs.from_cli_args(parser.parse_args(["--no-request-stories"])).create_engine_config()
    assert alone.scheduler.request_stories is False


# -- a command of its own (replay, bench executor) declares some of the options' flags, from the same fields -------

TP_HELP = "tensor parallel size, at most 4 on this copy"


def narrow_parallel_configs():
    """A copy of the configs whose tensor_parallel_size has other help and one more check."""
    from devharness.config import ParallelConfig

    def post_init(self):
        ParallelConfig.__post_init__(self)
        if self.tensor_parallel_size > 4:
            raise ConfigError("ParallelConfig", "tensor_parallel_size",
                              f"ParallelConfig.tensor_parallel_size={self.tensor_parallel_size}: at most 4 here")

    par = msgspec.defstruct("ParallelConfig", [("tensor_parallel_size", Annotated[int, Option(TP_HELP, flag="--tp")],
                                                1)], bases=(ParallelConfig,), kw_only=True,
                            namespace={"__post_init__": post_init})
    return dict(CONFIGS, parallel=par)


@pytest.mark.parametrize("command", [["replay"], ["bench", "executor"]])
def test_replay_and_bench_executor_flags_follow_the_config_field(monkeypatch, capsys, command):
    argv = [*command, "/no/such/recording"] if command == ["replay"] else command
    # The real configs: --tp 8 passes their checks, --tp 0 does not, and the help is the field's.
    ns = devharness.cli.build_parser().parse_args([*argv, "--tp", "8"])
    check_option_flags(ns)
    assert devharness.cli.main([*argv, "--tp", "0"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [err.rstrip("\n")] and \
        "argument --tp: ParallelConfig.tensor_parallel_size=0: must be an integer >= 1" in err, err

    monkeypatch.setattr(devharness.engine.args, "CONFIGS", narrow_parallel_configs())
    parser = devharness.cli.build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args([*command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"--tp TP {TP_HELP}" in text, text
    assert devharness.cli.main([*argv, "--tp", "8"]) == 2   # the copy's own check, before anything starts
    err = capsys.readouterr().err
    assert err == "devharness: error: argument --tp: ParallelConfig.tensor_parallel_size=8: at most 4 here\n", err
    check_option_flags(parser.parse_args([*argv, "--tp", "3"]))


def test_replay_takes_the_recordings_values_unless_a_flag_is_given():
    parser = devharness.cli.build_parser()
    ns = parser.parse_args(["replay", "/no/such/recording"])
    assert (ns.tp, ns.pp, ns.executor, ns.model, ns.threads_per_worker, ns.inject, ns.kernels) == (None,) * 7
    ns = parser.parse_args(["bench", "executor"])
    assert (ns.tp, ns.pp, ns.threads_per_worker, ns.model) == (2, 2, 1, EngineArgs().model)


@pytest.mark.parametrize("spec, words", [("bogus", "unknown fault 'bogus'"),
                                         ("raise:step=0:rank=0", "step=0 is out of range"),
                                         ("allreduce-drop:layer=1", "allreduce-drop needs rank=")])
def test_a_bad_fault_spec_is_refused_by_the_config_alike_from_llm_engine_args_and_the_cli(spec, words, capsys):
    named = f"EngineConfig.inject={spec!r}: {words}"
    with pytest.raises(ValueError, match=re.escape(named)):
        LLM("tiny-llama", inject=spec)
    with pytest.raises(ValueError, match=re.escape(named)):
        EngineArgs(inject=spec).create_engine_config()
    for argv in (["generate", "--prompt", "x"], ["replay", "/no/such/recording"], ["check"]):
        assert devharness.cli.main([*argv, "--inject", spec]) == 2
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"devharness: error: argument --inject: {named}"), (argv, lines)
    assert EngineArgs(inject="none").create_engine_config().inject is None   # replay's "no bug", anywhere


def test_llm_takes_its_default_model_from_the_config(monkeypatch):
    """LLM() restates no default: a copy of ModelConfig with another default model is what LLM() asks for."""
    from devharness.config import ModelConfig
    model = msgspec.defstruct("ModelConfig", [("model", Annotated[str, Option("which weights", metavar="M")],
                                               "smollm2")], bases=(ModelConfig,), kw_only=True)
    monkeypatch.setattr(devharness.engine.llm, "EngineArgs", make_engine_args(dict(CONFIGS, model=model)))
    asked = []

    class Stop(Exception):
        pass

    def start(config):
        asked.append(config.model.model)
        raise Stop

    monkeypatch.setattr(devharness.engine.llm.EngineRunner, "start", staticmethod(start))
    for args in ((), ("tiny-llama",)):
        with pytest.raises(Stop):
            LLM(*args)
    assert asked == ["smollm2", "tiny-llama"]
