"""The GPU checks (tests/gpu) skip where torch sees no CUDA device, so a CPU run never executes them: they are held
to the code they test here, from their source. Every name they import from devharness or tests exists; every call
of an imported function or class binds to its signature, and the keywords that go on to an engine (LLM's,
run_check's, run_batch_check's, and in tests/gpu a dict(...)'s) are EngineArgs' fields; every argv they hand the
CLI parses; every fixture a test asks for exists; every stand-in they monkeypatch in takes each call the code
makes of what it replaces. (tests/worker/test_device_placement.py runs test_engine_cuda's look on the CPU.)"""
import ast
import copy
import dataclasses
import importlib
import inspect
import pathlib
import textwrap
import types

import pytest

from devharness.cli import build_parser
from devharness.engine.args import EngineArgs, check_option_flags

TESTS = pathlib.Path(__file__).parent
GPU_MODULES = sorted((TESTS / "gpu").glob("*.py"))
ENGINE_KEYWORDS = {f.name for f in dataclasses.fields(EngineArgs)}
# Callables whose **kwargs are an engine's arguments (EngineArgs.from_kwargs takes them).
TAKES_ENGINE_KWARGS = {"devharness.engine.llm.LLM", "devharness.monitor.check.run_check",
                       "devharness.monitor.check.run_batch_check"}
PYTEST_FIXTURES = {"tmp_path", "tmp_path_factory", "monkeypatch", "capsys", "capfd", "caplog", "request"}


def _imports(tree: ast.AST, where: str, problems: list[str]) -> dict[str, object]:
    """Every name the source imports from devharness or tests (at any depth), resolved; a missing one is a problem."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 \
                and node.module.split(".")[0] in ("devharness", "tests"):
            try:
                module = importlib.import_module(node.module)
            except ImportError:
                problems.append(f"{where}:{node.lineno}: no module {node.module}")
                continue
            for a in node.names:
                try:
                    names[a.asname or a.name] = getattr(module, a.name) if hasattr(module, a.name) else \
                        importlib.import_module(f"{node.module}.{a.name}")
                except ImportError:
                    problems.append(f"{where}:{node.lineno}: {node.module} has no {a.name}")
    return names


def _call_shape(call: ast.Call, bound: bool = False) -> tuple[list, dict, bool]:
    """(positional placeholders, keyword placeholders, whether */** hide some) of a call; `bound`: a method's
    call, its self passed first."""
    hidden = any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords)
    positional = [None] * (bound + sum(not isinstance(a, ast.Starred) for a in call.args))
    return positional, {k.arg: None for k in call.keywords if k.arg}, hidden


def _binds(sig: inspect.Signature, call: ast.Call, bound: bool = False) -> str | None:
    args, kwargs, hidden = _call_shape(call, bound)
    try:
        (sig.bind_partial if hidden else sig.bind)(*args, **kwargs)
    except TypeError as e:
        return str(e)
    return None


def _signature_of(fn: ast.FunctionDef | ast.Lambda) -> inspect.Signature:
    """A stand-in's signature, from its source (defaults and annotations left out: only what binds matters)."""
    args = copy.deepcopy(fn.args)
    args.defaults = [ast.Constant(None) for _ in args.defaults]
    args.kw_defaults = [None if d is None else ast.Constant(None) for d in args.kw_defaults]
    for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
        if a is not None:
            a.annotation = None
    namespace = {}
    exec(f"def standin({ast.unparse(args)}): pass", namespace)
    return inspect.signature(namespace["standin"])


def _call_sites(target, attr: str) -> list[tuple[str, ast.Call, bool]]:
    """The calls the code makes of `attr`: a module's function by its bare name there, or a class's method on any
    object in the class's module; (where, call, whether self comes first)."""
    module = target if isinstance(target, types.ModuleType) else inspect.getmodule(target)
    path = pathlib.Path(inspect.getsourcefile(module))
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(target, types.ModuleType) and isinstance(f, ast.Name) and f.id == attr:
            found.append((f"{path.name}:{node.lineno}", node, False))
        elif not isinstance(target, types.ModuleType) and isinstance(f, ast.Attribute) and f.attr == attr:
            found.append((f"{path.name}:{node.lineno}", node, True))
    return found


def _standins(tree: ast.AST, names: dict, where: str, problems: list[str]) -> None:
    """monkeypatch.setattr("pkg.mod.name", f) and monkeypatch.setattr(Class or module, "name", f): f (a def of the
    source, or a lambda) takes every call the code makes of what it replaces."""
    defs = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            defs.setdefault(node.name, []).append(node)
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and ast.unparse(node.func).endswith("monkeypatch.setattr")):
            continue
        args = node.args
        if len(args) == 2 and isinstance(args[0], ast.Constant):
            module, attr = args[0].value.rsplit(".", 1)
            target, value = importlib.import_module(module), args[1]
        elif len(args) == 3 and isinstance(args[0], ast.Name) and args[0].id in names \
                and isinstance(args[1], ast.Constant):
            target, attr, value = names[args[0].id], args[1].value, args[2]
        else:
            continue
        standins = [value] if isinstance(value, ast.Lambda) else defs.get(getattr(value, "id", None), [])
        sites = _call_sites(target, attr)
        if not sites:
            problems.append(f"{where}:{node.lineno}: nothing in the code calls {attr}: the stand-in stands for nothing")
        for fn in standins:
            sig = _signature_of(fn)
            for site, call, bound in sites:
                err = _binds(sig, call, bound)
                if err:
                    problems.append(f"{where}:{fn.lineno}: stand-in {getattr(fn, 'name', 'lambda')}{sig} for {attr} "
                                    f"does not take the call at {site} ({ast.unparse(call)}): {err}")


def _calls(tree: ast.AST, names: dict, where: str, problems: list[str]) -> None:
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f, obj = node.func, None
        if isinstance(f, ast.Name) and f.id in names:
            obj = names[f.id]
        elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) \
                and isinstance(names.get(f.value.id), types.ModuleType):
            obj = getattr(names[f.value.id], f.attr, None)
            if obj is None:
                problems.append(f"{where}:{node.lineno}: {names[f.value.id].__name__} has no {f.attr}")
                continue
        elif isinstance(f, ast.Name) and f.id == "dict":   # in tests/gpu, a dict of keywords is an engine's
            unknown = sorted(k.arg for k in node.keywords if k.arg and k.arg not in ENGINE_KEYWORDS)
            if unknown:
                problems.append(f"{where}:{node.lineno}: {ast.unparse(node)}: not engine arguments: {unknown}")
            continue
        if obj is None or not callable(obj):
            continue
        try:
            sig = inspect.signature(obj)
        except (TypeError, ValueError):
            continue
        err = _binds(sig, node)
        if err:
            problems.append(f"{where}:{node.lineno}: {ast.unparse(node)} does not bind {obj.__qualname__}: {err}")
        if f"{obj.__module__}.{obj.__qualname__}" in TAKES_ENGINE_KWARGS:
            unknown = sorted(k.arg for k in node.keywords if k.arg and k.arg not in sig.parameters
                             and k.arg not in ENGINE_KEYWORDS)
            if unknown:
                problems.append(f"{where}:{node.lineno}: {obj.__qualname__} given unknown engine arguments {unknown}")
        if obj.__qualname__ == "main" and obj.__module__ == "devharness.cli" and node.args \
                and isinstance(node.args[0], ast.List):
            argv = [ast.literal_eval(a) for a in node.args[0].elts]
            try:
                check_option_flags(build_parser().parse_args(argv))
            except Exception as e:   # the parser's UsageError, a config's ValueError
                problems.append(f"{where}:{node.lineno}: devharness {' '.join(argv)}: {e}")


def _fixtures(tree: ast.AST) -> set[str]:
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
            and any("fixture" in ast.unparse(d) for d in n.decorator_list)}


def _test_arguments(tree: ast.Module, where: str, known: set[str], problems: list[str]) -> None:
    known = known | _fixtures(tree)
    for fn in tree.body:
        if not (isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_")):
            continue
        params = {p.strip() for d in fn.decorator_list if isinstance(d, ast.Call) and "parametrize" in ast.unparse(d)
                  for p in d.args[0].value.split(",")}
        missing = [a.arg for a in fn.args.args if a.arg not in known | params]
        if missing:
            problems.append(f"{where}:{fn.lineno}: {fn.name} asks for no such fixture: {missing}")


def problems_of(source: str, where: str) -> list[str]:
    tree = ast.parse(source)
    problems: list[str] = []
    names = _imports(tree, where, problems)
    _calls(tree, names, where, problems)
    _standins(tree, names, where, problems)
    conftests = [TESTS / "conftest.py", TESTS / "gpu" / "conftest.py"]
    known = PYTEST_FIXTURES.union(*(_fixtures(ast.parse(c.read_text())) for c in conftests if c.exists()))
    _test_arguments(tree, where, known, problems)
    return problems


@pytest.mark.parametrize("path", GPU_MODULES, ids=[p.name for p in GPU_MODULES])
def test_the_gpu_checks_hold_to_the_code(path):
    assert problems_of(path.read_text(), f"tests/gpu/{path.name}") == []


PLANTED = {
    "a stand-in of sample's old three arguments": ("""
        from devharness.model import sampler
        def test_x(monkeypatch):
            sample = sampler.sample
            def checked_sample(logits, batch, argmax):
                return sample(logits, batch, argmax)
            monkeypatch.setattr("devharness.worker.model_runner.sample", checked_sample)
        """, "stand-in checked_sample(logits, batch, argmax) for sample does not take the call at model_runner.py:"),
    "a method's stand-in without self": ("""
        from devharness.worker.model_runner import ModelRunner
        def test_x(monkeypatch):
            monkeypatch.setattr(ModelRunner, "prepare_inputs", lambda so: so)
        """, "stand-in lambda(so) for prepare_inputs does not take the call"),
    "a stand-in for what nothing calls": ("""
        def test_x(monkeypatch):
            monkeypatch.setattr("devharness.worker.model_runner.sample_rows", lambda *a: None)
        """, "nothing in the code calls sample_rows"),
    "a name that is gone": ("from devharness.monitor.check import run_chek\n",
                            "devharness.monitor.check has no run_chek"),
    "a module that is gone": ("from devharness.monitor.checks import run_check\n",
                              "no module devharness.monitor.checks"),
    "a module's function that is gone": ("from devharness.model import sampler\nsampler.sample_all(1)\n",
                                         "devharness.model.sampler has no sample_all"),
    "a keyword the function lacks": ("from tests.helpers import mixed_prompts\nmixed_prompts(3, sed=2)\n",
                                     "does not bind mixed_prompts"),
    "an engine argument that is not one": ("""
        from devharness.monitor.check import run_check
        run_check("tiny-llama", {}, 1e-4, decode_steps=2, devcie="cuda")
        """, "run_check given unknown engine arguments ['devcie']"),
    "a dict of engine arguments with a stranger": ("LAYOUT = dict(tensor_parallel=2)\n",
                                                   "not engine arguments: ['tensor_parallel']"),
    "a CLI flag that is not one": ("""
        from devharness.cli import main
        main(["check", "--model", "tiny-llama", "--tensor-parallel", "2"])
        """, "devharness check --model tiny-llama --tensor-parallel 2: "),
    "a fixture that is not one": ("def test_y(tiny_llama_dir):\n    pass\n",
                                  "asks for no such fixture: ['tiny_llama_dir']"),
}


@pytest.mark.parametrize("case", PLANTED)
def test_each_rule_can_fail(case):
    source, said = PLANTED[case]
    found = problems_of(textwrap.dedent(source), "planted.py")
    assert len(found) == 1 and said in found[0], found
