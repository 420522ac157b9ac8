"""Nothing from the network is unpickled or evaluated: the code that reads sockets, HTTP, shared memory
and Ray replies has no pickle.loads, cloudpickle, eval(, exec( or marshal.loads, nor what unpickles
underneath (torch.load, torch.distributed's *_object collectives). Only code is searched,
not comments or strings (tokenize), so saying "no pickle" in a docstring is fine. The self-check plants
a line in a temporary file and expects it found, so this test can fail."""
import io
import re
import tokenize
from pathlib import Path

import devharness

ROOT = Path(devharness.__file__).parent
NETWORK_CODE = ["server", "distributed", "worker/worker_loop.py", "tui", "executor"]
# Code joined without spaces, so "pickle . loads" reads "pickle.loads"; a method .eval() is not eval().
FORBIDDEN = re.compile(r"\b(?:c?pickle|marshal|dill)\.loads?\b|\bfrom (?:c?pickle|marshal|dill) import\b"
                       r"|\bcloudpickle\b|(?<![\w.])(?:eval|exec)\(|\btorch\.load\("
                       r"|\b(?:broadcast|recv|scatter|gather|all_gather)_object(?:_list)?\(")
_TEXT = {tokenize.COMMENT, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}


def forbidden_lines(path: Path) -> list[str]:
    """'file:line: code' for each line of `path` whose code (comments and strings left out) matches FORBIDDEN."""
    lines: dict[int, str] = {}
    prev = None
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline):
        if tok.type in _TEXT or tok.type in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            continue
        row = tok.start[0]
        sep = " " if prev is not None and prev.type == tok.type == tokenize.NAME and prev.start[0] == row else ""
        lines[row] = lines.get(row, "") + sep + tok.string
        prev = tok
    return [f"{path}:{row}: {code}" for row, code in sorted(lines.items()) if FORBIDDEN.search(code)]


def test_network_code_never_unpickles_or_evaluates():
    files = sorted(f for part in NETWORK_CODE for f in ([ROOT / part] if part.endswith(".py")
                                                         else (ROOT / part).rglob("*.py")))
    assert len(files) > 20 and all(f.is_file() for f in files)
    found = [hit for f in files for hit in forbidden_lines(f)]
    assert not found, "code that reads the network must not unpickle or evaluate:\n" + "\n".join(found)


def test_the_search_finds_a_planted_line(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('"""Docstrings may say pickle.loads(data) and eval(text)."""\n'
                       "import torch  # cloudpickle in a comment is fine\n"
                       "model = torch.nn.Linear(1, 1).eval()\n"
                       "safe = ast.literal_eval('1')\n"
                       "msg = f'{eval}'\n"
                       "def handle(sock):\n"
                       "    return pickle . loads(sock.recv(1024))\n"
                       "import cloudpickle\n"
                       "from marshal import loads\n"
                       "x = eval (sock.recv(9))\n"
                       "exec(code)\n"
                       "state = torch.load(io.BytesIO(payload))\n"
                       "dist.recv_object_list(objs, src=0)\n")
    hits = forbidden_lines(planted)
    assert [h.split(": ")[0] for h in hits] == [f"{planted}:{n}" for n in range(7, 14)], hits
