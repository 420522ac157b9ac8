"""Secrets (the server's API key and debug token) never leave the process in what it shows of itself.

py-spy starts every dump with the process's command line, where `--api-key K` and `--debug-token T` sit
when given as flags; the stacks, a worker's log and a bundle's files pass through `redact` before they
are served or written. It masks the values the process registered (`add_secret`: the server registers
its key and tokens, a generated one included) and, for a process whose secrets are not known here (a
dump read on another node), the value after any secret-named flag in a command line.
"""
from __future__ import annotations

import re

MASK = "<redacted>"
# A flag whose last word is key, token, secret or password (not `--max-num-batched-tokens`), then its value
# (up to a quote or backslash: in a JSON string or a repr the closing quote stays).
_FLAG_VALUE = re.compile(r"""(--(?:[A-Za-z0-9]+-)*(?:key|token|secret|password))(=|[ \t]+)(?!<redacted>)[^\s"'\\]+""")
_secrets: set[str] = set()


def add_secret(value: str | None) -> None:
    """From now on `redact` masks `value` wherever it appears (None: nothing to mask)."""
    if value:
        _secrets.add(value)


def redact(text: str) -> str:
    """`text` with every registered secret and every secret flag's value replaced by MASK."""
    for secret in sorted(_secrets, key=len, reverse=True):   # longest first: one secret may hold another
        if secret in text:
            text = text.replace(secret, MASK)
    return _FLAG_VALUE.sub(lambda m: f"{m[1]}{m[2]}{MASK}", text)
