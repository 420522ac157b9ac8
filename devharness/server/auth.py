"""Who may call what. `/v1` needs `Authorization: Bearer <api key>` when the server has one (--api-key);
`/debug` needs `Authorization: Bearer <debug token>` when the server binds anything but loopback (the
token is --debug-token's, else one made here and printed once in the startup banner) or when
--debug-token is given. /health, /metrics and the OpenAPI pages stay open. A refusal is a 401 in
OpenAI's error shape, decided before the request reaches a route or its body is read."""
from __future__ import annotations

import dataclasses
import hmac
import ipaddress
import secrets

from devharness.server.errors import error_response

API_PREFIX = "/v1"
DEBUG_PREFIX = "/debug"
PROFILE_ROUTES = ("/start_profile", "/stop_profile")   # server/profile_api.py


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or "localhost"; anything else (0.0.0.0, "", a name) counts as reachable by others."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclasses.dataclass(frozen=True)
class ServerAuth:
    """The tokens one server checks: `api_key` guards /v1 and `debug_token` guards /debug (None: open)."""

    api_key: str | None = None
    debug_token: str | None = None
    debug_token_generated: bool = False   # made here, so the banner must print it (once)

    @classmethod
    def for_bind(cls, host: str, debug: bool, api_key: str | None = None,
                 debug_token: str | None = None) -> "ServerAuth":
        """A server binding `host`: off loopback its debug routes are never open, whatever was given."""
        for flag, value in (("--api-key", api_key), ("--debug-token", debug_token)):
            if value is not None:
                check_token(value, flag)
        if debug and debug_token is None and not is_loopback(host):
            return cls(api_key, new_token(), debug_token_generated=True)
        return cls(api_key, debug_token if debug else None)

    def guards(self) -> dict[str, str]:
        """Path prefix → the token it needs (the profiler's routes, vLLM's top-level paths, as /debug)."""
        return {p: t for p, t in ((API_PREFIX, self.api_key), (DEBUG_PREFIX, self.debug_token),
                                  *((r, self.debug_token) for r in PROFILE_ROUTES)) if t is not None}


def new_token() -> str:
    """A generated debug token: 256 random bits in hex, so it never starts with '-' (which a command line would take
    for a flag: `devharness bundle --token <token>`, as the banner says) and holds nothing a shell or a URL treats
    specially."""
    return secrets.token_hex(32)


def check_token(value: str, flag: str) -> str:
    """A token an HTTP header can carry: printable ASCII, no spaces; else ValueError naming the flag."""
    if not value or not all(33 <= ord(c) < 127 for c in value):
        raise ValueError(f"{flag} must be a non-empty string of printable ASCII characters without spaces")
    return value


_HINTS = {API_PREFIX: ("invalid_api_key", "this server needs its API key: send 'Authorization: Bearer <api key>' "
                                          "(the server's --api-key)"),
          DEBUG_PREFIX: ("invalid_debug_token",
                         "the /debug routes need 'Authorization: Bearer <debug token>': the server's --debug-token, "
                         "or the token its startup banner printed (devharness tui|bundle --token T)")}
_HINTS.update(dict.fromkeys(PROFILE_ROUTES, _HINTS[DEBUG_PREFIX]))


class BearerAuth:
    """ASGI middleware: a request under a guarded prefix without the right Bearer token gets a 401.
    By prefix, not per route, so a route added later under /v1 or /debug is guarded too."""

    def __init__(self, app, guards: dict[str, str]):
        self.app = app
        self.guards = {prefix: token.encode() for prefix, token in guards.items()}

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            path = scope.get("path", "")
            for prefix, token in self.guards.items():
                if (path == prefix or path.startswith(prefix + "/")) and not _presents(scope, token):
                    code, message = _HINTS[prefix]
                    resp = error_response(401, message, code)
                    resp.headers["WWW-Authenticate"] = "Bearer"
                    return await resp(scope, receive, send)
        return await self.app(scope, receive, send)


def _presents(scope, token: bytes) -> bool:
    value = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
    scheme, _, given = value.partition(b" ")
    # compare_digest: the time taken says nothing about how much of the token was right.
    return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), token)
