"""The API's front door, as pure ASGI middleware that runs before any route reads a byte of the body.

`AuthGate` decides on the credential first. With a token configured (`PLAB_API_TOKEN`), every write under
/api/v1 needs a `write` credential, token management an `admin` one, and with `PLAB_AUTH=all` every read a
`read` one (/api/v1/health excepted). A credential is a bearer token (`Authorization: Bearer <token>`: the
bootstrap PLAB_API_TOKEN or a scoped token, backend/auth.py) or the dashboard's session cookie, whose writes
must also carry the CSRF header. A missing, malformed, non-ASCII or unknown credential is answered 401 at
once, a known one without the scope 403, so an anonymous client can neither make the server parse a large or
malformed body nor learn anything from a 422. The caller found is left in `scope["state"]["plab_principal"]`.
Then the
body limit (`PLAB_MAX_BODY_BYTES`, default 16 MiB): a declared Content-Length over it is answered 413 before
the body is read; a body without one (chunked) is read up to the limit and answered 413 as soon as it passes
it, never buffered beyond it.

`SecurityHeaders` adds to every response a Content-Security-Policy that allows scripts from this origin only
(no inline script, no eval; the dashboard's styles and Plotly's inline styles are allowed), and the headers
that forbid framing and MIME sniffing.
"""
from __future__ import annotations

import hmac
import json

WRITE_METHODS = frozenset({b"POST", b"PUT", b"PATCH", b"DELETE"})
OPEN_PATHS = frozenset({"/api/v1/health"})
DEFAULT_MAX_BODY = 16 * 1024 * 1024

CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; "
       "font-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; "
       "form-action 'self'")
SECURITY_HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
]


async def _answer(send, status: int, detail: str, extra: list | None = None) -> None:
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra or [])})
    await send({"type": "http.response.body", "body": body})


def bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The token of a well-formed `Authorization: Bearer <token>` header (printable ASCII), else None."""
    values = [v for k, v in headers if k == b"authorization"]
    if len(values) != 1:
        return None
    scheme, _, token = values[0].strip().partition(b" ")
    token = token.strip()
    if scheme.lower() != b"bearer" or not token or len(token) > 512:
        return None
    if any(c < 0x21 or c > 0x7E for c in token):
        return None
    return token


def token_matches(headers, expected: str) -> bool:
    token = bearer_token(headers)
    return token is not None and hmac.compare_digest(token, expected.encode())


SESSION_PATH = "/api/v1/session"
TOKENS_PATH = "/api/v1/tokens"


class AuthGate:
    def __init__(self, app, settings, tokens=None):
        from backend.auth import session_key

        self.app = app
        self.settings = settings
        self.tokens = tokens  # backend.auth.TokenStore (None: only the bootstrap token is known)
        self.key = session_key(settings.api_token) if settings.api_token else None

    def _needed(self, scope) -> str | None:
        """The scope this request needs, None when it is open (or the route decides: the session routes)."""
        path = scope["path"]
        if not self.settings.api_token or not path.startswith("/api/v1") or path in OPEN_PATHS or path == SESSION_PATH:
            return None
        method = scope["method"].encode()
        if path == TOKENS_PATH or path.startswith(TOKENS_PATH + "/"):
            return "admin"
        if method in WRITE_METHODS:
            return "write"
        return "read" if self.settings.auth_mode == "all" and method != b"OPTIONS" else None

    async def _principal(self, scope):
        """(Principal or None, problem or None): the caller a bearer header or the session cookie proves."""
        from anyio import to_thread

        from backend.auth import Principal, cookie_value, read_cookie

        if not self.settings.api_token:
            return None, None
        headers = scope["headers"]
        if any(k == b"authorization" for k, _ in headers):
            raw = bearer_token(headers)
            found = None
            if raw is not None:
                found = (await to_thread.run_sync(self.tokens.by_secret, raw) if self.tokens is not None
                         else (("bootstrap", "admin") if hmac.compare_digest(raw, self.settings.api_token.encode())
                               else None))
            return (Principal(found[0], found[1], "bearer"), None) if found else (None, "bad-token")
        cookie = cookie_value(headers)
        named = read_cookie(self.key, cookie) if cookie else None
        if named is None:
            return None, None
        found = await to_thread.run_sync(self.tokens.by_id, named) if self.tokens is not None else None
        if found is None and named == "bootstrap":
            found = ("bootstrap", "admin")
        return (Principal(found[0], found[1], "cookie"), None) if found else (None, None)

    async def _refusal(self, scope, principal, problem, needed):
        """(status, message) when the request may not proceed, else None."""
        from backend.auth import CSRF_HEADER, cookie_value, csrf_token

        if problem == "bad-token":
            return 401, ("the API token sent is not valid (malformed, unknown or revoked): send 'Authorization: "
                         "Bearer <token>' with PLAB_API_TOKEN or a token from `plab token create`")
        if needed is None:
            return None
        if principal is None:
            what = {"read": "every request", "write": "writes", "admin": "token management"}[needed]
            return 401, (f"this server requires an API token for {what}: send the header 'Authorization: Bearer "
                         f"<token>' (PLAB_API_TOKEN, or a token from `plab token create`), or sign in on the "
                         f"dashboard")
        if principal.via == "cookie" and scope["method"].encode() in WRITE_METHODS:
            sent = [v for k, v in scope["headers"] if k == CSRF_HEADER]
            expected = csrf_token(self.key, cookie_value(scope["headers"])).encode()
            if len(sent) != 1 or not hmac.compare_digest(sent[0], expected):
                return 403, ("a write signed in by the session cookie needs the X-CSRF-Token header (the 'csrf' "
                             "value of GET /api/v1/session)")
        if not principal.allows(needed):
            return 403, f"this token's scope is '{principal.scope}'; this request needs '{needed}'"
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        principal, problem = await self._principal(scope)
        refusal = await self._refusal(scope, principal, problem, self._needed(scope))
        if refusal is not None:
            status, message = refusal
            return await _answer(send, status, message, [(b"www-authenticate", b"Bearer")] if status == 401 else [])
        scope.setdefault("state", {})["plab_principal"] = principal
        limit = self.settings.max_body_bytes
        declared = [v for k, v in scope["headers"] if k == b"content-length"]
        if declared:
            try:
                size = int(declared[0])
            except ValueError:
                return await _answer(send, 400, "Content-Length is not a number")
            if size > limit:
                return await _answer(send, 413, f"request body of {size} bytes is over this server's limit of "
                                     f"{limit} bytes (PLAB_MAX_BODY_BYTES); send less, e.g. smaller batches")
            return await self.app(scope, _counted(receive, limit), send)
        if scope["method"].encode() not in WRITE_METHODS:
            return await self.app(scope, receive, send)
        body = await _read_up_to(receive, limit)
        if body is None:
            return await _answer(send, 413, f"request body is over this server's limit of {limit} bytes "
                                 "(PLAB_MAX_BODY_BYTES); send less, e.g. smaller batches")
        return await self.app(scope, _replay(body, receive), send)


def _counted(receive, limit: int):
    """A declared length is trusted only as far as the bytes agree: more than `limit` ends the request."""
    seen = 0

    async def wrapped():
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                return {"type": "http.disconnect"}
        return message
    return wrapped


async def _read_up_to(receive, limit: int) -> bytes | None:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body"):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive):
    sent = False

    async def wrapped():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return wrapped


class SecurityHeaders:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def with_headers(message):
            if message["type"] == "http.response.start":
                present = {k.lower() for k, _ in message.get("headers", [])}
                message = {**message, "headers": list(message.get("headers", []))
                           + [(k, v) for k, v in SECURITY_HEADERS if k not in present]}
            await send(message)
        await self.app(scope, receive, with_headers)
