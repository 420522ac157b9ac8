"""The package's shape (docs/design.md, "Layers"), read from its source: module-level imports form no cycle, nothing
imports the CLI (it only dispatches), and the TUI, which may watch a server on another machine,
starts without torch or Ray."""
import ast
import pathlib
import re
import subprocess
import sys

import devharness

ROOT = pathlib.Path(devharness.__file__).resolve().parent


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def module_level_imports(path: pathlib.Path) -> set[str]:
    """devharness modules `path` imports when it is imported (not inside functions: those are lazy).
    `from pkg import sub` names the module pkg.sub; `from pkg import name` names pkg."""
    tree = ast.parse(path.read_text(), str(path))
    found = set()
    for node in tree.body:
        if isinstance(node, ast.If):   # `if TYPE_CHECKING:` imports nothing at run time
            continue
        for sub in ast.walk(node):
            if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                break
            if isinstance(sub, ast.Import):
                found |= {a.name for a in sub.names}
            elif isinstance(sub, ast.ImportFrom) and sub.module and sub.level == 0:
                for a in sub.names:
                    full = f"{sub.module}.{a.name}"
                    found.add(full if full in MODULES else sub.module)
    return {m for m in found if m in MODULES}


def import_graph() -> dict[str, set[str]]:
    return {name: module_level_imports(p) - {name} for name, p in MODULES.items()}


def all_imports() -> dict[str, set[str]]:
    """Every devharness import of every module, lazy ones (inside functions) included."""
    out = {}
    for p in ROOT.rglob("*.py"):
        tree = ast.parse(p.read_text(), str(p))
        names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__" and node.args \
                    and isinstance(node.args[0], ast.Constant):
                names.add(node.args[0].value)
        out[module_name(p)] = names
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (c := visit(m)):
                return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (c := visit(n)):
            return c
    return None


def test_the_graph_reader_sees_imports_and_cycles():
    """The checks below can fail: the reader finds a known import and a planted cycle."""
    graph = import_graph()
    assert "devharness.engine.core" in graph["devharness.engine.llm_engine"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_module_level_imports_have_no_cycle():
    assert find_cycle(import_graph()) is None


def test_nothing_imports_the_cli():
    importers = sorted(m for m, names in all_imports().items()
                       if m != "devharness.cli" and any(n == "devharness.cli" or n.startswith("devharness.cli.")
                                                        for n in names))
    assert importers == [], f"the CLI only dispatches; these import it: {importers}"


# Arrows point down (docs/design.md, "Layers"): the model knows nothing of who runs or watches it, the collectives
# know nothing of the model, and the wire (protocol/: plain data and its codecs) imports nothing of devharness but
# itself and the plain data it carries: the sampling parameters (step messages) and the engine config (a recording's
# manifest; config.py imports nothing of devharness but the grammar of its fault specs, which imports nothing of
# devharness). Lazy imports (inside functions) count too.
ALLOWED_INSIDE = {
    "devharness.model": ("devharness.model", "devharness.distributed", "devharness.protocol"),
    "devharness.distributed": ("devharness.distributed", "devharness.protocol"),
    "devharness.protocol": ("devharness.protocol", "devharness.sampling_params", "devharness.config"),
    "devharness.config": ("devharness.fault_spec",),
    "devharness.fault_spec": (),
}


def forbidden_imports(package: str, allowed: tuple[str, ...]) -> dict[str, list[str]]:
    out = {}
    for module, names in all_imports().items():
        if module != package and not module.startswith(package + "."):
            continue
        bad = sorted(n for n in names if n.startswith("devharness") and
                     not any(n == a or n.startswith(a + ".") for a in allowed))
        if bad:
            out[module] = bad
    return out


def test_the_model_and_the_collectives_import_only_downward():
    for package, allowed in ALLOWED_INSIDE.items():
        assert forbidden_imports(package, allowed) == {}, f"{package} may import only {allowed}"


def test_the_layering_check_can_fail():
    # The debug side imports the model (it installs hooks): seen as forbidden if it were held to the model's rule.
    assert "devharness.debug.breakpoints" in forbidden_imports("devharness.debug", ALLOWED_INSIDE["devharness.model"])


# The layers, bottom to top (docs/design.md, "Layers"): a module imports from its own layer and those below it only,
# imports inside functions included. The ground is plain data and its grammar (and the package root, whose body
# imports nothing: its Python API is resolved on first use, and `from devharness import LLM` is read as the import
# of devharness.engine.llm it is); diagnostics/ is what the running engine needs to explain itself; the tools that
# drive an engine from outside (monitor/: check and the views), the server and the TUI stand on the engine.
LAYERS = [
    ("devharness", "devharness.config", "devharness.sampling_params", "devharness.protocol", "devharness.fault_spec"),
    ("devharness.kernels",),
    ("devharness.distributed",),
    ("devharness.model",),
    ("devharness.debug",),
    ("devharness.diagnostics",),
    ("devharness.worker",),
    ("devharness.executor",),
    ("devharness.engine",),
    ("devharness.monitor", "devharness.server", "devharness.tui"),
    ("devharness.bench",),
    ("devharness.cli",),
]
# The one cycle between files: the executor factory (Executor.get_class) imports the backend it chooses.
FACTORY_EDGES = {("devharness.executor.base", f"devharness.executor.{b}") for b in ("uniproc", "multiproc", "ray")}


def layer_of(module: str) -> int | None:
    """The index in LAYERS of `module`'s layer (the longest name that holds it; the root only as itself)."""
    best = None
    for i, names in enumerate(LAYERS):
        for n in names:
            if module == n or (n != "devharness" and module.startswith(n + ".")):
                if best is None or len(n) > best[1]:
                    best = (i, len(n))
    return None if best is None else best[0]


def _package_face() -> dict[str, str]:
    """The names devharness/__init__.py resolves on first use, and the module each comes from (its _WHERE)."""
    for node in ast.parse((ROOT / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_WHERE" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("devharness/__init__.py has no _WHERE")


def source_imports(source: str, modules=None) -> set[str]:
    """Every devharness module `source` imports, anywhere (inside functions too, and `__import__("name")`), as the
    file it names: `from pkg import sub` names pkg.sub, `from pkg import name` names pkg, and `from devharness import
    LLM` the module the package face resolves it from. What `if TYPE_CHECKING:` imports never runs: not read."""
    modules = MODULES if modules is None else modules
    face = _package_face()
    tree = ast.parse(source)
    skipped = {id(sub) for node in ast.walk(tree)
               if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) for sub in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if node.module == "devharness" and a.name in face:
                    found.add(face[a.name])
                else:
                    found.add(full if full in modules else node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__" and node.args \
                and isinstance(node.args[0], ast.Constant):
            found.add(node.args[0].value)
    return {m for m in found if m in modules}


def every_import_graph() -> dict[str, set[str]]:
    return {name: source_imports(p.read_text()) - {name} for name, p in MODULES.items()}


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """`importer -> imported` for each import of a module from a higher layer than the importer's."""
    return sorted(f"{m} -> {n}" for m, names in graph.items() for n in names if layer_of(n) > layer_of(m))


def test_every_module_has_a_layer():
    assert sorted(m for m in MODULES if layer_of(m) is None) == [], "place the new package in LAYERS and docs/design.md"


def test_every_import_points_down():
    """No module imports from a higher layer, lazily (inside a function) or not."""
    assert upward_imports(every_import_graph()) == []


def test_no_cycle_between_files_but_the_executor_factory():
    """Every import counted, lazy ones too: no two files import each other, directly or around a loop, but the
    executor factory and the backend it chooses."""
    graph = every_import_graph()
    assert FACTORY_EDGES <= {(m, n) for m, names in graph.items() for n in names}
    assert find_cycle({m: {n for n in names if (m, n) not in FACTORY_EDGES} for m, names in graph.items()}) is None


def test_the_layer_and_cycle_rules_can_fail():
    """A planted upward import inside a function is seen, and so is a cycle between two files."""
    planted = ("import logging\n\ndef write(engine):\n    from devharness.monitor.check import run_check\n"
               "    return run_check\n")
    graph = {"devharness.engine.core": source_imports(planted)}
    assert graph["devharness.engine.core"] == {"devharness.monitor.check"}
    assert upward_imports(graph) == ["devharness.engine.core -> devharness.monitor.check"]
    assert upward_imports({"devharness.monitor.check": {"devharness.engine.core"}}) == []
    assert source_imports("from devharness import LLM, __version__\n") == {"devharness.engine.llm", "devharness"}
    assert source_imports("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import devharness.cli\n") == set()
    two = {"devharness.engine.engine_loop": {"devharness.engine.runner"},
           "devharness.engine.runner": {"devharness.engine.engine_loop"}}
    assert find_cycle(two) == ["devharness.engine.engine_loop", "devharness.engine.runner",
                               "devharness.engine.engine_loop"]
    assert layer_of("devharness") == 0
    assert layer_of("devharness.diagnostics.hang") == LAYERS.index(("devharness.diagnostics",))


def test_importing_the_tui_loads_neither_torch_nor_ray():
    code = ("import sys, devharness.tui.app; "
            "print(sorted(m for m in ('torch', 'ray', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_the_package_face_still_offers_the_python_api():
    from devharness import LLM, CompletionOutput, EngineArgs, RequestOutput, SamplingParams
    assert LLM.__module__ == "devharness.engine.llm" and SamplingParams.__module__ == "devharness.sampling_params"
    assert EngineArgs.__module__ == "devharness.engine.args"
    assert RequestOutput.__module__ == CompletionOutput.__module__ == "devharness.engine.output"


def test_every_file_the_package_reads_ships_with_it():
    # The C kernels (kernels/native.c) and the TUI's stylesheet are read at run time: an install that left one out
    # (package-data in pyproject.toml) would run the eager kernels, or no TUI, without saying why.
    import re
    toml = (ROOT.parent / "pyproject.toml").read_text()
    section = toml.split("[tool.setuptools.package-data]", 1)[1].split("\n[", 1)[0]
    patterns = re.findall(r'"([^"]+)"', re.search(r"^devharness\s*=\s*\[(.*?)\]", section, re.M | re.S).group(1))
    shipped = {p for pattern in patterns for p in ROOT.glob(pattern)}
    data = {p for p in ROOT.rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc")
            and "__pycache__" not in p.parts}
    assert {ROOT / "kernels" / "native.c", ROOT / "tui" / "app.tcss"} <= data
    assert sorted(str(p.relative_to(ROOT)) for p in data - shipped) == []


def exported_c_functions(source: str) -> dict[str, str]:
    """name -> body of every non-static function defined at the top level of a C file."""
    import re
    out = {}
    for m in re.finditer(r"^(?!static)[A-Za-z_][\w \t\*]*?\b(\w+)\s*\([^;{]*\)\s*\{", source, re.M):
        depth, i = 1, m.end()
        while depth:
            depth += {"{": 1, "}": -1}.get(source[i], 0)
            i += 1
        out[m.group(1)] = source[m.end():i - 1]
    return out


def composed_kernels(source: str) -> dict[str, list[str]]:
    """Exported C functions that call two or more of the file's other exported kernels: a model written in C."""
    import re
    funcs = exported_c_functions(source)
    calls = {name: sorted(other for other in funcs if other != name and re.search(rf"\b{other}\s*\(", body))
             for name, body in funcs.items()}
    return {name: called for name, called in calls.items() if len(called) >= 2}


def test_no_c_copy_of_the_model_and_the_model_is_handed_its_kernels():
    """One engine: each C kernel is one op (none strings several ops together into a decoder layer), and the model
    imports no kernel module: it computes through the kernels the worker hands it (set_kernels)."""
    sources = {p: p.read_text() for p in ROOT.rglob("*.c")}
    assert sources, "the C kernels are expected under devharness/"
    for path, source in sources.items():
        assert len(exported_c_functions(source)) >= 5, path   # the reader sees the kernels
        assert composed_kernels(source) == {}, f"{path} composes kernels into a layer"
    # The rule can fail: a function that runs a norm, a product and the attention is seen.
    planted = ("void rms_norm_f32(float *x) { x[0] = 1; }\nvoid packed_linear_f32(float *x) { x[0] = 2; }\n"
               "int paged_decode_f32(float *x) { return 0; }\n"
               "int decode_layers_f32(float *x) {\n  rms_norm_f32(x);\n  packed_linear_f32(x);\n"
               "  return paged_decode_f32(x);\n}\n")
    assert composed_kernels(planted) == {"decode_layers_f32": ["packed_linear_f32", "paged_decode_f32",
                                                               "rms_norm_f32"]}
    kernel_importers = sorted(m for m, names in all_imports().items() if m.startswith("devharness.model")
                              and any(n == "devharness.kernels" or n.startswith("devharness.kernels.") for n in names))
    assert kernel_importers == [], f"the model is handed its kernels; these import them: {kernel_importers}"


def fault_words(source: str) -> list[str]:
    """Identifiers that speak of planted faults (fault, inject, corrupt, stall) in Python source."""
    names = {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Attribute)}
    names |= {n.name for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    words = {"fault", "faults", "inject", "injected", "corrupt", "stall"}
    return sorted(n for n in names if words & set(n.lower().split("_")))


def test_faults_are_planted_from_outside_the_model_and_the_collectives():
    """The model keeps generic hook sites only (none that one planted fault needs) and the collectives have no
    fault switch: debug/faults.py plants each fault through hooks, a collective observer or a wrapped op."""
    from devharness.model import hooks
    sites = {n for n, f in vars(hooks.ModelHooks).items() if callable(f) and not n.startswith("_")}
    # partial_output: the partial sum for watchers that need no weight (the numerics check), generic like the rest.
    assert sites == {"layer_start", "layer_end", "layers_done", "partial_sum", "partial_output", "sublayer_output"}, \
        sites
    for path in [*sorted((ROOT / "model").glob("*.py")), ROOT / "distributed" / "collectives.py"]:
        assert fault_words(path.read_text()) == [], f"{path} speaks of faults: {fault_words(path.read_text())}"
    # The rule can fail: a module-global switch is seen.
    assert fault_words("_fault = None\ndef set_fault(f):\n    global _fault\n    _fault = f\n") == ["_fault",
                                                                                             "set_fault"]


def module_registries(source: str) -> list[str]:
    """Process-wide state in Python source: module names a function rebinds (`global`), and module-level names that
    speak of hooks, observers or watchers (a registry every instance would share)."""
    tree = ast.parse(source)
    found = sorted({name for node in ast.walk(tree) if isinstance(node, ast.Global) for name in node.names})
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        found += [t.id for t in targets if isinstance(t, ast.Name)
                  and any(w in t.id.lower() for w in ("hook", "observer", "installed", "watch"))]
    return found


def test_the_model_keeps_no_process_wide_hook_registry():
    """Each model holds its own HookSet: two engines in one process never call each other's hooks."""
    for path in sorted((ROOT / "model").glob("*.py")):
        assert module_registries(path.read_text()) == [], f"{path} keeps process-wide state: " \
                                                          f"{module_registries(path.read_text())}"
    # The rule can fail: a module-level registry of installed hooks, rebuilt by a function, is seen.
    planted = "layer_start: tuple = ()\n_installed: list = []\n\ndef _rebuild():\n    global layer_start\n" \
              "    layer_start = tuple(_installed)\n"
    assert module_registries(planted) == ["layer_start", "_installed"]


def msgpack_decoders(source: str) -> list[str]:
    """The types a module builds msgpack decoders for (`msgspec.msgpack.Decoder(T)`, `msgspec.msgpack.decode(...,
    type=T)`), as source text."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                ast.unparse(node.func) in ("msgspec.msgpack.Decoder", "msgspec.msgpack.decode"):
            if node.func.attr == "Decoder" and node.args:
                found.append(ast.unparse(node.args[0]))
            found += [ast.unparse(k.value) for k in node.keywords if k.arg == "type"]
    return found


def json_decoders(source: str) -> list[str]:
    """The types a module decodes JSON or builtins into with msgspec (`msgspec.json.Decoder(T)`,
    `msgspec.json.decode(..., type=T)`, `msgspec.convert(x, T)` or `type=T`), as source text; untyped decodes (to
    dicts and lists) are not decoders of a type."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        name = ast.unparse(node.func)
        if name == "msgspec.json.Decoder" and node.args:
            found.append(ast.unparse(node.args[0]))
        elif name == "msgspec.convert" and len(node.args) > 1:
            found.append(ast.unparse(node.args[1]))
        if name in ("msgspec.json.Decoder", "msgspec.json.decode", "msgspec.convert"):
            found += [ast.unparse(k.value) for k in node.keywords if k.arg == "type"]
    return found


def wire_names() -> set[str]:
    """The names protocol/ defines at its top level: its types (Structs, unions) among them."""
    names = set()
    for p in (ROOT / "protocol").glob("*.py"):
        for node in ast.parse(p.read_text()).body:
            if isinstance(node, ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def foreign_json_decoders(source: str, wire: set[str]) -> list[str]:
    """A module's msgspec JSON decoders (and converts) of anything but its own shapes: a type it does not define
    itself (a wire type, or a parameter that may be one), or one of its own classes that holds a wire type."""
    tree = ast.parse(source)
    own = {n.name for n in tree.body if isinstance(n, ast.ClassDef)
           and not wire & set(re.findall(r"\w+", ast.unparse(n)))}
    return [t for t in json_decoders(source) if t not in own]


# A frame header in network byte order ("!" or ">"): what goes between machines. The shared-memory layouts
# (debug/board.py, debug/ledger.py) are in the host's order, read on the same host.
STRUCT_CALLS = {f"{m}{f}" for m in ("struct.", "") for f in ("Struct", "pack", "pack_into", "unpack", "unpack_from",
                                                              "iter_unpack", "calcsize")}


def frame_headers(source: str) -> list[str]:
    """struct formats in network byte order a module declares (`struct.Struct("!I")`, `struct.pack(">Q", n)`...)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and ast.unparse(node.func) in STRUCT_CALLS and node.args and \
                isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str) and \
                node.args[0].value[:1] in ("!", ">"):
            found.append(node.args[0].value)
    return found


def test_one_wire_one_decoder_per_type():
    """Payloads, frames, their codecs and the recording format live in devharness/protocol: no module elsewhere
    builds a msgpack decoder, a msgspec JSON decoder (or convert) of a type it does not define itself, or a frame
    header; protocol/ builds one decoder per type and codec, and declares each frame header once."""
    outside = [p for p in ROOT.rglob("*.py") if "protocol" not in p.relative_to(ROOT).parts]
    inside = sorted((ROOT / "protocol").glob("*.py"))
    wire = wire_names()
    assert {"Ledger", "Snapshot", "RecordedStep", "Manifest", "StepCall", "Reply", "ControlCall"} <= wire
    assert {str(p.relative_to(ROOT)): d for p in outside if (d := msgpack_decoders(p.read_text()))} == {}, \
        "msgpack decoders outside devharness/protocol"
    assert {str(p.relative_to(ROOT)): d for p in outside if (d := foreign_json_decoders(p.read_text(), wire))} == {}, \
        "JSON decoders of wire types outside devharness/protocol"
    assert {str(p.relative_to(ROOT)): h for p in outside if (h := frame_headers(p.read_text()))} == {}, \
        "frame headers outside devharness/protocol"
    msgpack = [t for p in inside for t in msgpack_decoders(p.read_text())]
    assert len(msgpack) >= 8 and len(msgpack) == len(set(msgpack)), sorted(msgpack)
    json_ = [t for p in inside for t in json_decoders(p.read_text())]
    assert {"Ledger", "Snapshot", "Manifest"} <= set(json_) and len(json_) == len(set(json_)), sorted(json_)
    headers = [h for p in inside for h in frame_headers(p.read_text())]
    assert headers and len(headers) == len(set(headers)), headers
    # The rules can fail: a second decoder of a type is seen, in either codec, and so is a frame header.
    assert msgpack_decoders("d = msgspec.msgpack.Decoder(Reply)\nx = msgspec.msgpack.decode(b, type=list[int])\n") \
        == ["Reply", "list[int]"]
    planted = ("class _Mine(msgspec.Struct):\n    n: int\nclass _Holds(msgspec.Struct):\n    led: Ledger\n"
               "a = msgspec.json.decode(b, type=Ledger)\nb = msgspec.json.Decoder(list[Ledger], strict=False)\n"
               "c = msgspec.convert(d, EngineStats)\nd = msgspec.convert(d, type=Snapshot)\n"
               "def f(body, type_):\n    return msgspec.json.decode(body, type=type_)\n"
               "e = msgspec.json.decode(b, type=_Holds)\n"
               "mine = msgspec.json.Decoder(_Mine)\nuntyped = msgspec.json.decode(b)\n")
    assert sorted(foreign_json_decoders(planted, wire)) == ["EngineStats", "Ledger", "Snapshot", "_Holds",
                                                            "list[Ledger]", "type_"]
    assert frame_headers('_HEADER = struct.Struct("!I")\nn = struct.pack(">Q", 3)\nh = Struct("!HH")\n'
                         'shm = struct.Struct("<QQ")\nx = struct.pack("256s", b)\n') == ["!I", ">Q", "!HH"]


def bench_importers(imports: dict[str, set[str]]) -> list[str]:
    return sorted(m for m, names in imports.items() if not m.startswith("devharness.bench") and m != "devharness.cli"
                  and any(n == "devharness.bench" or n.startswith("devharness.bench.") for n in names))


def test_benchmarks_stay_outside_the_engine():
    """Nothing outside bench/ imports from it (the CLI, which dispatches to every command, aside): the benches use
    the engine's public interfaces, and nothing in the engine exists for them."""
    assert bench_importers(all_imports()) == []
    assert bench_importers({"devharness.engine.core": {"devharness.bench.executor"}}) == ["devharness.engine.core"]


WORKER_SIDE = {"worker", "workers", "runner", "recorder", "ledger", "actor", "actors", "Worker", "ModelRunner",
               "StateRecorder", "CollectiveLedger", "debug_state", "collectives"}


# The engine's insides that a bench must not read: its core, scheduler, a worker and its runner (the benches ask the
# engine: scheduler_snapshot, unfinished_request_ids, workers.model_in_process, ...).
ENGINE_INSIDES = {"core", "scheduler", "worker", "runner"}


def assignment_targets(node) -> list:
    if isinstance(node, (ast.Assign, ast.Delete)):
        return node.targets
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    return []


def reads_engine_insides(tree) -> list[str]:
    """Attributes a bench reads that are not an engine object's public interface: a private one (`x._name`, other
    than of `self`/`cls`; dunders aside) and a `.core`, `.scheduler`, `.worker` or `.runner` (each step of a chain
    named). What an assignment's target reads is the write rule's."""
    in_targets = {id(sub) for node in ast.walk(tree) for t in assignment_targets(node) for sub in ast.walk(t)}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not isinstance(node.ctx, ast.Load) or id(node) in in_targets:
            continue
        name = node.attr
        private = name.startswith("_") and not (name.startswith("__") and name.endswith("__")) and \
            not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        if private or name in ENGINE_INSIDES:
            found.append(ast.unparse(node))
    for node in ast.walk(tree):   # the same read spelled getattr(x, "name")
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and len(node.args) >= 2 and \
                isinstance(node.args[1], ast.Constant) and isinstance(name := node.args[1].value, str) and \
                (name in ENGINE_INSIDES or name.startswith("_") and not name.startswith("__")) and \
                not (isinstance(node.args[0], ast.Name) and node.args[0].id in ("self", "cls")):
            found.append(ast.unparse(node))
    return found


def reaches_into_workers(source: str) -> list[str]:
    """What a bench does to the engine and its workers besides calling their public interfaces: Ray's `__ray_call__`
    (a function run on an actor); an attribute of a worker, runner, recorder or ledger (or of their classes and
    modules) assigned, deleted or set with setattr/delattr; and a read of the engine's insides (reads_engine_insides:
    private attributes, `.core`, `.scheduler`, `.worker`, `.runner`)."""
    found = []

    def worker_side(node) -> bool:
        return bool(WORKER_SIDE & set(re.findall(r"\w+", ast.unparse(node))))

    tree = ast.parse(source)
    found += reads_engine_insides(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "__ray_call__" or \
                isinstance(node, ast.Constant) and node.value == "__ray_call__":
            found.append(ast.unparse(node))
        targets = assignment_targets(node)
        found += [ast.unparse(t) for t in targets for sub in ast.walk(t)
                  if isinstance(sub, ast.Attribute) and worker_side(sub.value)][:1] if targets else []
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("setattr", "delattr") and node.args \
                and worker_side(node.args[0]):
            found.append(ast.unparse(node))
    return found


def test_benchmarks_reach_the_workers_through_their_interfaces():
    """The benches measure the workers through the profiler's control calls (LLMEngine.start_profile), and `bench
    throughput` sees each step's forward inputs through torch's forward pre-hook on the model the uni executor hands
    out (Executor.model_in_process): nothing in bench/ runs code on a Ray actor by `__ray_call__`, swaps a worker's,
    runner's or recorder's attributes, or reads the engine's insides (its private attributes, its core, scheduler,
    worker or runner: the benches ask LLMEngine's public accessors)."""
    assert {str(p.relative_to(ROOT)): f for p in sorted((ROOT / "bench").glob("*.py"))
            if (f := reaches_into_workers(p.read_text()))} == {}
    # The rule can fail: what bench debug-overhead did before the profiler (and bench throughput before the hook).
    before = ("ray.get([a.__ray_call__.remote(f) for a in executor.actors])\n"
              "worker.runner.execute_model = alternate\ndel worker.runner.execute_model\n"
              "setattr(debug_state.StateRecorder, name, wrapped)\nself.worker.publish = None\n"
              "core.flight = None\nllm.x = 1\nrunner.prepare_inputs = capture\n")
    assert sorted(reaches_into_workers(before)) == ["a.__ray_call__", "runner.prepare_inputs", "self.worker.publish",
                                                    "setattr(debug_state.StateRecorder, name, wrapped)",
                                                    "worker.runner.execute_model", "worker.runner.execute_model"]
    # And reads: what the benches read before the engine's accessors (unfinished_request_ids, scheduler_snapshot,
    # workers.model_in_process), a private attribute of any object but self, and a chain through the core.
    reads = ("for rid in list(engine._trackers):\n    engine.abort_request(rid)\n"
             "sched = engine.core.scheduler\nn = len(sched.running)\n"
             "model = engine.workers.worker.runner.model\n"
             "step = llm.engine.core.scheduler.step_count\nkept = core.flight\n"
             "self._buf = b''\nx = self._buf + cls._seq\nname = f.__name__\nengine.workers.control(GetState())\n")
    assert sorted(reaches_into_workers(reads)) == [
        "engine._trackers", "engine.core", "engine.core.scheduler", "engine.workers.worker",
        "engine.workers.worker.runner", "llm.engine.core", "llm.engine.core.scheduler"]
    assert reaches_into_workers("s = getattr(engine, 'core')\nt = getattr(engine, '_trackers', {})\n"
                                "ok = getattr(args, 'token', None)\n") == \
        ["getattr(engine, 'core')", "getattr(engine, '_trackers', {})"]
    assert sorted(reaches_into_workers("kept = engine.core.flight\n")) == ["engine.core"] and \
        reaches_into_workers("s = engine.scheduler_snapshot()\nx = s.running\nm = engine.workers.model_in_process()\n") == []


# LLMEngine is the one door to its core (engine/core.py: the scheduler and the workers): it and the modules that make a
# core of their own (replay) read `.core`; everyone else asks the engine's accessors or its runner.
CORE_READERS = {"devharness.engine.llm_engine", "devharness.engine.core", "devharness.engine.replay"}


def core_reads(source: str) -> list[str]:
    """Every `x.core` (and getattr(x, "core")) in `source`."""
    tree = ast.parse(source)
    return [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "core"] + \
        [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "getattr"
         and len(n.args) >= 2 and isinstance(n.args[1], ast.Constant) and n.args[1].value == "core"]


def test_nothing_reaches_past_the_engine_into_its_core():
    """The runner, the fronts (LLM, AsyncLLM), diagnostics, check and the server ask LLMEngine (step_count, stats,
    debug_view, workers, ...) and never read its core."""
    assert {m: f for m, p in MODULES.items() if m not in CORE_READERS and (f := core_reads(p.read_text()))} == {}
    # The rule can fail: what the bundle writer and check's prefix plan read before the engine's accessors.
    assert core_reads("core = engine.core\nbm = llm.engine.core.scheduler.block_manager\n"
                      "c = getattr(engine, 'core')\nfrom prometheus_client.core import GaugeMetricFamily\n") == [
        "engine.core", "llm.engine.core", "getattr(engine, 'core')"]


# An error's text: str()/repr() of an exception, its args or message, or a name or field that holds one
# (`error`, `recorded_error`, `exc`, `e`...), and what text methods make of these (lower(), splitlines()[0]...). A
# name that says it holds a kind, type or code (`error_kind`) is the typed decision this rule asks for.
ERROR_PARTS = {"e", "ex", "exc", "err", "error", "errors", "exception", "cause"}
TYPED_PARTS = {"kind", "type", "code", "count", "class", "cls", "id"}
TEXT_METHODS = {"lower", "upper", "casefold", "strip", "lstrip", "rstrip", "splitlines", "split", "partition"}


def _names_an_error(node) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    parts = set(name.lower().split("_")) if name is not None else set()
    return bool(ERROR_PARTS & parts) and not TYPED_PARTS & parts


def is_error_text(node) -> bool:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("str", "repr", "format") \
            and node.args:
        return _names_an_error(node.args[0]) or is_error_text(node.args[0])
    if isinstance(node, ast.Call) and ast.unparse(node.func) in ("traceback.format_exc", "traceback.format_exception"):
        return True
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in TEXT_METHODS:
        return is_error_text(node.func.value)
    if isinstance(node, ast.Subscript):   # str(e)[:20], e.args[0], error.splitlines()[0]
        v = node.value
        return isinstance(v, ast.Call) and is_error_text(v) or \
            isinstance(v, ast.Attribute) and v.attr == "args" and _names_an_error(v.value)
    if isinstance(node, ast.Attribute) and node.attr in ("message", "msg", "args"):
        return _names_an_error(node.value)
    return _names_an_error(node)


def decided_by_error_text(source: str) -> list[str]:
    """Where a module decides on an error's text: a string looked for in it (`"x" in str(e)`; any text that looks
    for "died"/"dead"/"killed"), compared with it, or matched against it (`.startswith(`, `.endswith(`, `.find(`,
    `.index(`, `.count(`, `re.search`/`re.match`/`re.fullmatch`/`re.findall`, a compiled pattern's)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            for op, a, b in zip(node.ops, sides, sides[1:]):
                literal = [x for x in (a, b) if isinstance(x, ast.Constant) and isinstance(x.value, str)]
                if isinstance(op, (ast.In, ast.NotIn)) and a in literal and (
                        any(w in a.value.lower() for w in ("died", "dead", "killed")) or is_error_text(b)) or \
                        isinstance(op, (ast.Eq, ast.NotEq)) and literal and any(is_error_text(x) for x in (a, b)):
                    found.append(ast.unparse(node))
                    break
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if f.attr in ("find", "rfind", "index", "rindex", "count", "startswith", "endswith") and \
                    is_error_text(f.value):
                found.append(ast.unparse(node))
            elif f.attr in ("search", "match", "fullmatch", "findall", "finditer"):
                text = node.args[1:2] if ast.unparse(f.value) == "re" else node.args[:1]
                if text and is_error_text(text[0]):
                    found.append(ast.unparse(node))
    return found


def test_errors_are_decided_by_type_not_text():
    """A dead worker is a WorkerDied from the executor, and a recorded step that did not finish carries its error's
    kind (protocol/recording.py): no module decides on an error by matching its text."""
    found = {str(p.relative_to(ROOT)): decided_by_error_text(p.read_text()) for p in ROOT.rglob("*.py")}
    assert {p: f for p, f in found.items() if f} == {}
    # The rule can fail: each way of reading an error's text is seen, and text that is not an error's is not.
    assert decided_by_error_text('dead = "died" in str(e) or "dead" in str(e)\n') == ["'died' in str(e)",
                                                                                       "'dead' in str(e)"]
    planted = ('a = self.recorded_error.startswith("failed")\nb = str(exc).endswith("timed out")\n'
               'c = str(e).find("rank") >= 0\nd = re.search(r"rank \\d+", str(err))\n'
               'f = re.match("OOM", error.splitlines()[0])\ng = "boom" in e.args[0]\nh = str(e) == "gone"\n'
               'i = PATTERN.search(exc.message)\nj = "boom" not in traceback.format_exc()\n'
               'k = step.error_kind == "failed"\nl = name.startswith("rank")\nm = "x" in line\n'
               'n = re.search("a", text)\no = err_count.bit_length()\n')
    assert sorted(decided_by_error_text(planted)) == sorted([
        "self.recorded_error.startswith('failed')", "str(exc).endswith('timed out')", "str(e).find('rank')",
        "re.search('rank \\\\d+', str(err))", "re.match('OOM', error.splitlines()[0])", "'boom' in e.args[0]",
        "str(e) == 'gone'", "PATTERN.search(exc.message)", "'boom' not in traceback.format_exc()"])


# What only the engine's runner does (engine/runner.py): run the hang detector, write bundles, restart the
# workers, remove their run files. Elsewhere only the layers below it, each restarting what it holds when told
# (LLMEngine its core, the core its executor, an executor its workers, whose old files go first), and replay,
# which starts workers of its own without an engine.
LIFE_CALLS = {
    "HangDetector": {"devharness.engine.runner"},
    "BundleWriter": {"devharness.engine.runner"},
    "remove_run_files": {"devharness.engine.runner", "devharness.executor.base", "devharness.engine.replay"},
    "restart_workers": {"devharness.engine.runner", "devharness.engine.llm_engine", "devharness.engine.core",
                        "devharness.executor.ray"},
}


def calls_named(source: str, names) -> set[str]:
    """Which of `names` `source` calls (as a function or a method)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in names:
                found.add(name)
    return found


def life_calls(source: str) -> set[str]:
    """The names of LIFE_CALLS that `source` calls."""
    return calls_named(source, LIFE_CALLS)


# What only the runner (engine/runner.py) and its thread (engine/engine_loop.py) do with a served engine: step it,
# add and abort its requests, report failures to the state machine and carry out its answer, run a thread for it.
LOOP_CALLS = {"step", "add_processed", "abort_request", "workers_failed", "restart", "restart_workers",
              "restart_failed", "restart_done", "step_completed", "crashed", "check_health", "shutdown", "Thread",
              "Condition"}


def loop_calls(source: str) -> set[str]:
    """The names of LOOP_CALLS that `source` calls."""
    return calls_named(source, LOOP_CALLS)


def test_one_owner_of_life_and_death():
    """LLM, AsyncLLM, LLMEngine and EngineCore neither restart nor tidy up on their own: the runner does. And
    AsyncLLM holds no loop that steps the engine: it never steps it, adds or aborts in it, restarts its workers or
    reports a failure, and starts no thread; the runner and the engine loop it starts do, and the loop knows
    nothing of asyncio."""
    strays = {(name, m) for m, p in MODULES.items() for name in life_calls(p.read_text())
              if m not in LIFE_CALLS[name]}
    assert strays == set()
    assert life_calls("self.engine.restart_workers(x)\nremove_run_files(r)\nw = BundleWriter(e)\n") == {
        "restart_workers", "remove_run_files", "BundleWriter"}
    assert loop_calls(MODULES["devharness.engine.async_llm"].read_text()) == set()
    assert {"step", "add_processed", "abort_request", "workers_failed", "restart", "check_health", "shutdown",
            "Thread", "Condition"} <= loop_calls(MODULES["devharness.engine.engine_loop"].read_text()) | loop_calls(
        MODULES["devharness.engine.runner"].read_text())
    assert not any(i.split(".")[0] == "asyncio" for i in all_imports()["devharness.engine.engine_loop"])
    assert "asyncio" in all_imports()["devharness.engine.async_llm"]
    assert loop_calls("outputs = self.engine.step(1)\nself.runner.restart()\nthreading.Thread(target=f)\n") == {
        "step", "restart", "Thread"}


# The one runner: an engine (LLMEngine) or its core (EngineCore) is stepped by engine/runner.py's EngineRunner alone,
# inline (LLM.generate) or on its thread (the server), so that a failed step, a restart and a shutdown happen in one
# place. LLMEngine.step is the runner's one way in: it steps its own core. The benchmarks time a bare engine's steps,
# with no runner and nothing to restart.
ENGINE_STEPPERS = {"devharness.engine.runner", "devharness.engine.llm_engine", "devharness.bench.throughput",
                   "devharness.bench.executor", "devharness.bench.debug_overhead", "devharness.bench.numerics_overhead",
                   "devharness.bench.single_stream"}


def engine_steps(source: str) -> list[str]:
    """The calls in `source` that step an engine or its core: `.step(...)` on something named engine or core
    (`engine.step()`, `self.engine.step(1)`, `llm.engine.core.step()`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "step":
            owner = node.func.value
            name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
            if name in ("engine", "core", "llm_engine", "engine_core"):
                found.append(ast.unparse(node))
    return found


def test_only_the_runner_steps_the_engine():
    strays = {m: engine_steps(p.read_text()) for m, p in MODULES.items() if m not in ENGINE_STEPPERS}
    assert {m: s for m, s in strays.items() if s} == {}
    assert engine_steps(MODULES["devharness.engine.runner"].read_text()) == ["self.engine.step(max_in_flight)"]
    planted = ("def generate(self):\n    for out in self.engine.step():\n        pass\n"
               "    while llm.engine.core.step(1):\n        pass\n    self.runner.step()\n    self.profiler.step(f)\n")
    assert engine_steps(planted) == ["self.engine.step()", "llm.engine.core.step(1)"]
