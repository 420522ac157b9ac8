"""EngineArgs, `LLM(...)`'s keywords and the CLI's engine flags, all derived from the config structs' fields.

An engine option is declared once, as a field of a config in devharness/config.py (its default, its help text
and flag in an `Option`, its check in the config's `__post_init__`). From those fields this module makes:
- `EngineArgs`: a flat dataclass with one field per option (vLLM's names; `debug` is a bool or a whole
  DebugConfig), which `LLM(...)` and `AsyncLLM.from_engine_args` take; `create_engine_config()` groups and checks
  them (each config raises ValueError naming the field);
- the flags: `EngineArgs.add_cli_args(parser)` declares one per option (its help, type, choices and default
  from the field), `EngineArgs.from_cli_args(ns)` reads them back; `add_option_flags(parser, names, defaults)`
  declares some of them on a command of its own (replay, a bench) with that command's defaults; and
  `check_option_flags(ns)` holds the values given to the configs' own checks, naming the flag of a bad one.
`make_engine_args(configs)` builds the class from any set of configs (a test adds a field to a copy). The CLI
only dispatches; nothing imports it.
"""
from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass

import msgspec

from devharness.config import ConfigError, DebugConfig, EngineConfig, ModelConfig, Option, ParallelConfig, SchedulerConfig

# Where each config sits in EngineConfig ("" for EngineConfig's own fields), in the order EngineArgs lists them.
CONFIGS: dict[str, type] = {"model": ModelConfig, "parallel": ParallelConfig, "scheduler": SchedulerConfig,
                            "": EngineConfig, "debug": DebugConfig}


@dataclass(frozen=True)
class EngineOption:
    """One option: the config field it is (`config` names where the config sits in EngineConfig) and how users
    give it (`option`)."""

    config: str
    name: str
    type: object          # the field's type, its Annotated wrapper removed
    default: object
    option: Option

    @property
    def flag(self) -> str:
        return self.option.flag or "--" + self.name.replace("_", "-")

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")

    @property
    def keyword(self) -> bool:
        """An EngineArgs field of its own (DebugConfig's fields reach EngineArgs as one `debug`)."""
        return self.config != "debug"

    def argparse_kwargs(self) -> dict:
        o = self.option
        kw: dict = {"help": o.help, "dest": self.dest}
        if self.type is bool:
            kw["action"] = argparse.BooleanOptionalAction if self.default else "store_true"
            kw["default"] = self.default
            return kw
        base = self.type
        if isinstance(base, types.UnionType) or typing.get_origin(base) is typing.Union:
            base = next(t for t in typing.get_args(base) if t is not type(None))
        if base is bool:   # None: the engine decides; --flag / --no-flag: the user does
            kw["action"], kw["default"] = argparse.BooleanOptionalAction, self.default
            return kw
        if o.parse is None and base not in (int, float, str):
            raise TypeError(f"option {self.name}: a {base} needs Option(parse=...) to be read from a flag")
        kw["type"] = o.parse or base
        kw["default"] = list(self.default) if isinstance(self.default, list) else self.default
        if o.choices:
            kw["choices"] = o.choices
        if o.metavar:
            kw["metavar"] = o.metavar
        return kw


def engine_options(configs: dict[str, type] = CONFIGS) -> list[EngineOption]:
    """Every option a user can set, config by config: fields carrying an `Option` that is not internal."""
    out = []
    for where, cls in configs.items():
        for f in msgspec.structs.fields(cls):
            if typing.get_origin(f.type) is not typing.Annotated:
                continue
            base, *extras = typing.get_args(f.type)
            option = next((e for e in extras if isinstance(e, Option)), None)
            if option is None or option.internal:
                continue
            default = f.default if f.default is not msgspec.NODEFAULT else f.default_factory()
            out.append(EngineOption(where, f.name, base, default, option))
    return out


class _EngineArgsMethods:
    """What every EngineArgs class does with its fields (the fields come from `make_engine_args`)."""

    configs: typing.ClassVar[dict[str, type]]
    options: typing.ClassVar[list[EngineOption]]

    def create_engine_config(self) -> EngineConfig:
        debug_cls = self.configs["debug"]
        debug = self.debug if isinstance(self.debug, debug_cls) else debug_cls(enabled=bool(self.debug))
        groups: dict[str, dict] = {where: {} for where in self.configs}
        for o in self.options:
            if o.keyword:
                groups[o.config][o.name] = getattr(self, o.name)
        subs = {where: cls(**groups[where]) for where, cls in self.configs.items() if where not in ("", "debug")}
        return self.configs[""](**subs, debug=debug, **groups[""])

    @classmethod
    def from_kwargs(cls, **kwargs):
        """`LLM(...)`'s keyword arguments; an unknown one is a ValueError naming it and the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**kwargs)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, debug: bool = False, record: bool = False,
                     restart: bool = False) -> argparse.ArgumentParser:
        """One flag per option; the options of a group ("debug", "record", "restart") where asked for. The values
        given are held to the configs' checks by check_option_flags (the CLI does, as it parses)."""
        asked = {"debug": debug, "record": record, "restart": restart}
        chosen = [o for o in cls.options if o.option.group is None or asked.get(o.option.group)]
        for o in chosen:
            parser.add_argument(o.flag, **o.argparse_kwargs())
        _declare(parser, cls.configs, [o.name for o in chosen])
        return parser

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace):
        """The flags `add_cli_args` declared, read back (an option whose flag the command lacks keeps its
        default); debug mode's fields make a DebugConfig when --debug is given."""
        kwargs = {o.name: getattr(ns, o.dest) for o in cls.options if o.keyword and hasattr(ns, o.dest)}
        if getattr(ns, "debug", False):
            kwargs["debug"] = cls.configs["debug"](**{o.name: getattr(ns, o.dest) for o in cls.options
                                                      if o.config == "debug" and hasattr(ns, o.dest)})
        else:
            kwargs["debug"] = False
        return cls(**kwargs)

    def kwargs(self) -> dict:
        """As `LLM(**engine_args.kwargs())` takes them (a shallow copy: DebugConfig stays one)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def make_engine_args(configs: dict[str, type] = CONFIGS) -> type:
    """The EngineArgs dataclass of these configs: a field per option (its type and default), then `debug`."""
    options = engine_options(configs)
    fields = []
    for o in options:
        if o.keyword:
            default = dataclasses.field(default_factory=lambda d=o.default: list(d)) \
                if isinstance(o.default, list) else dataclasses.field(default=o.default)
            fields.append((o.name, o.type, default))
    fields.append(("debug", bool | configs["debug"], dataclasses.field(default=False)))
    names = [f[0] for f in fields]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise TypeError(f"two configs declare the engine option(s) {', '.join(clash)}: an option is one field")
    doc = ("Keyword arguments of `LLM(...)` (vLLM's names), one per engine option of devharness/config.py; "
           "`debug` is a bool or a whole DebugConfig.")
    return dataclasses.make_dataclass("EngineArgs", fields, bases=(_EngineArgsMethods,), namespace={
        "__doc__": doc, "__module__": __name__, "configs": dict(configs), "options": options})


EngineArgs = make_engine_args()


def _by_name(configs: dict[str, type]) -> dict[str, EngineOption]:
    by_name: dict[str, EngineOption] = {}
    for o in engine_options(configs):
        if o.name in by_name:
            raise TypeError(f"two configs declare an option {o.name}: add_option_flags cannot tell them apart")
        by_name[o.name] = o
    return by_name


# Where a parser keeps the configs and the names of the options whose flags it declared, for check_option_flags.
_DECLARED = "_engine_options_declared"


def _declare(parser: argparse.ArgumentParser, configs: dict[str, type], names: list[str]) -> None:
    _, before = parser.get_default(_DECLARED) or (configs, [])
    parser.set_defaults(**{_DECLARED: (configs, [*before, *names])})


def add_option_flags(parser: argparse.ArgumentParser, names: list[str], defaults: dict | None = None,
                     notes: dict[str, str] | None = None, configs: dict[str, type] | None = None) -> None:
    """Some options' flags on a command of its own (replay, a bench), as the engine commands declare them: the
    config field's flag, type, choices and help. `defaults`: name -> this command's default (replay: None, "take
    the recording's"); `notes`: name -> what the help adds for this command (after a semicolon). The values given are checked by the
    configs themselves (check_option_flags)."""
    configs = configs or CONFIGS
    by_name = _by_name(configs)
    for name in names:
        o = by_name[name]
        kw = o.argparse_kwargs()
        if defaults and name in defaults:
            kw["default"] = defaults[name]
        if notes and name in notes:
            kw["help"] = f"{kw['help']}; {notes[name]}"
        parser.add_argument(o.flag, **kw)
    _declare(parser, configs, list(names))


def check_option_flags(ns: argparse.Namespace) -> None:
    """Hold the option flags a command declared (add_cli_args, add_option_flags) to their configs' checks: the
    values given (None: not given) go into the configs, the other fields keep their defaults. A value a config
    refuses is a ValueError naming the flag, then the config's own words."""
    declared = getattr(ns, _DECLARED, None)
    if declared is None:
        return
    configs, names = declared
    by_name = _by_name(configs)
    given: dict[str, dict] = {where: {} for where in configs}
    flags = {}
    for name in names:
        o = by_name[name]
        value = getattr(ns, o.dest, None)
        if value is not None:
            given[o.config][o.name] = value
            flags[(configs[o.config].__name__, o.name)] = o.flag
    try:
        subs = {where: cls(**given[where]) for where, cls in configs.items() if where != ""}
        configs[""](**subs, **given[""])
    except ConfigError as e:
        flag = flags.get((e.config, e.field))
        raise ValueError(f"argument {flag}: {e}" if flag else str(e)) from None


# -- the flag table of docs/cli.md ---------------------------------------------------------------------

_GROUP_COMMANDS = {None: "engine", "debug": "serve", "record": "generate, serve", "restart": "serve"}


def _shown(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None or value == []:
        return "–"
    return str(value)


def flag_table(configs: dict[str, type] = CONFIGS) -> str:
    """The engine flags as docs/cli.md's table rows (flag, commands, default, what), made from the options;
    `python -m devharness.engine.args` prints them."""
    rows = []
    for o in engine_options(configs):
        kw = o.argparse_kwargs()
        if "type" not in kw:   # a switch
            flags = f"`{o.flag}`" + (f", `--no-{o.flag[2:]}`" if kw["action"] is argparse.BooleanOptionalAction
                                     else "")
        else:
            arg = kw.get("metavar") or ("{" + ",".join(kw["choices"]) + "}" if "choices" in kw
                                        else {int: "N", float: "X"}.get(kw["type"], "S"))
            flags = f"`{o.flag} {arg}`"
        rows.append(f"| {flags} | {_GROUP_COMMANDS[o.option.group]} | {_shown(o.default)} | "
                    f"{o.option.help.replace('|', '/')} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(flag_table())
