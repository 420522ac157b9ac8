"""`.vscode/`: the attach configurations reach the ports debug mode listens on, the launch configuration
runs `devharness serve --debug`, the tasks run Makefile targets, and the test runner finds the tests."""
import json
import re
from importlib.metadata import entry_points
from pathlib import Path

from devharness.cli import build_parser
from devharness.config import DebugConfig

ROOT = Path(__file__).resolve().parent.parent
VSCODE = ROOT / ".vscode"
NUM_ATTACH = 4   # docs/debugging.md: one attach configuration per rank for 4 ranks, and a compound for all


def parse_jsonc(text: str):
    """JSON with // and /* */ comments, as VS Code reads its files (a // inside a string stays)."""
    return json.loads(re.sub(r'("(?:\\.|[^"\\])*")|//[^\n]*|/\*.*?\*/', lambda m: m.group(1) or "", text,
                             flags=re.S))


def load_jsonc(path: Path):
    return parse_jsonc(path.read_text())


def test_parse_jsonc_keeps_urls_and_drops_comments():
    assert parse_jsonc('// c\n{"u": "http://x//y", /* c */ "n": 1} // c') == {"u": "http://x//y", "n": 1}


def _resolve(path: str) -> Path:
    return Path(path.replace("${workspaceFolder}", str(ROOT)))


def test_attach_configurations_reach_each_ranks_default_port():
    launch = load_jsonc(VSCODE / "launch.json")
    configs = {c["name"]: c for c in launch["configurations"]}
    default = DebugConfig()
    for rank in range(NUM_ATTACH):
        c = configs[f"devharness: attach rank {rank}"]
        assert (c["type"], c["request"]) == ("debugpy", "attach")
        assert c["connect"]["port"] == default.port_base + rank
        assert c["connect"]["host"] == default.host and DebugConfig(host=c["connect"]["host"]).host_is_loopback
        for mapping in c["pathMappings"]:
            assert _resolve(mapping["localRoot"]).is_dir() and (_resolve(mapping["localRoot"]) / "devharness").is_dir()
    attach = [name for name, c in configs.items() if c["request"] == "attach"]
    assert len(attach) == NUM_ATTACH
    compounds = {c["name"]: c for c in launch["compounds"]}
    assert compounds["devharness: attach all ranks"]["configurations"] == attach


def test_launch_configuration_runs_serve_debug_through_the_cli_module():
    launch = load_jsonc(VSCODE / "launch.json")
    [serve] = [c for c in launch["configurations"] if c["request"] == "launch"]
    assert serve["type"] == "debugpy" and serve["name"].startswith("devharness: serve --debug")
    # The module is the one behind the `devharness` script, and runs as a module.
    [script] = entry_points(group="console_scripts", name="devharness")
    assert script.value == f"{serve['module']}:main"
    module_file = ROOT / Path(*serve["module"].split(".")).with_suffix(".py")
    assert 'if __name__ == "__main__":' in module_file.read_text()
    args = build_parser().parse_args(serve["args"])   # arguments the CLI takes
    assert args.command == "serve" and args.debug
    assert _resolve(serve["cwd"]) == ROOT
    # Workers are reached through the attach configurations: the session must not follow subprocesses.
    assert serve["subProcess"] is False


def test_tasks_run_makefile_targets():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
    tasks = load_jsonc(VSCODE / "tasks.json")["tasks"]
    assert tasks
    for task in tasks:
        words = task["command"].split()
        assert words[0] == "make" and words[1] in targets, task["label"]
    serve = next(t for t in tasks if t["label"].startswith("devharness: serve --debug"))
    assert serve["isBackground"]


def test_settings_run_pytest_on_tests():
    settings = load_jsonc(VSCODE / "settings.json")
    assert settings["python.testing.pytestEnabled"] is True
    assert settings["python.testing.pytestArgs"] == ["tests"] and (ROOT / "tests" / "conftest.py").is_file()
