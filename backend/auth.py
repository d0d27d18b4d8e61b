"""Who is calling: scoped API tokens and the dashboard's session cookie.

Tokens. `PLAB_API_TOKEN` is the bootstrap `admin` token (from the environment, never stored). Further tokens
are made with `plab token create NAME --scope read|write|admin` (or `POST /api/v1/tokens` with an admin token):
`plab_` + 32 random bytes, shown once; the database keeps only their SHA-256 (a random 256-bit secret needs no
slow hash: there is nothing to guess from), a display prefix, and when each was last used and revoked.
Scopes are ordered: `read` (GET), `write` (+ every write: experiments, runs, metrics - what workers need),
`admin` (+ managing tokens). A revoked token stops working within `CACHE_S` seconds.

Session cookie. The dashboard trades a token once for a cookie (`POST /api/v1/session` with the bearer
header): `plab_session`, HttpOnly (scripts cannot read it), SameSite=Strict (other sites' requests do not carry
it), Secure on HTTPS, signed with a key derived from PLAB_API_TOKEN (rotating it ends every session). It names
the token it was made from, which must still be valid. Writes authenticated by the cookie must also carry
`X-CSRF-Token`, the value `GET /api/v1/session` returns (an HMAC of the cookie): a forged cross-site form can
send the cookie (not with SameSite=Strict, but defence in depth) but cannot read that value.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import threading
import time
from dataclasses import dataclass

SCOPES = ("read", "write", "admin")
# A token's name, as the API (TokenIn) and `plab token create` accept it.
TOKEN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
TOKEN_NAME_MAX = 100
RANK = {scope: i for i, scope in enumerate(SCOPES)}
TOKEN_PREFIX = "plab_"
COOKIE = "plab_session"
CSRF_HEADER = b"x-csrf-token"
SESSION_TTL_S = 7 * 24 * 3600
CACHE_S = 2.0
BOOTSTRAP = "bootstrap"


@dataclass(frozen=True)
class Principal:
    """A verified caller: `token` is "bootstrap" (PLAB_API_TOKEN) or "t<id>" (a stored token)."""
    token: str
    scope: str
    via: str  # "bearer" | "cookie"

    def allows(self, needed: str) -> bool:
        return RANK[self.scope] >= RANK[needed]


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def token_hash(raw: str | bytes) -> str:
    return hashlib.sha256(raw if isinstance(raw, bytes) else raw.encode()).hexdigest()


class TokenStore:
    """Looks tokens up (bootstrap first, then the database by hash), with a short cache so a busy metric stream
    does not query the database on every request."""

    def __init__(self, sessionmaker, bootstrap: str | None):
        self.sessionmaker = sessionmaker
        self.bootstrap = bootstrap
        self._cache: dict[str, tuple[float, tuple[str, str] | None]] = {}
        self._lock = threading.Lock()

    def by_secret(self, raw: bytes) -> tuple[str, str] | None:
        """(principal id, scope) for a presented token, or None."""
        if self.bootstrap and hmac.compare_digest(raw, self.bootstrap.encode()):
            return BOOTSTRAP, "admin"
        if not raw.startswith(TOKEN_PREFIX.encode()):
            return None
        return self._cached("h" + token_hash(raw), lambda s: _row_by_hash(s, token_hash(raw)))

    def by_id(self, principal: str) -> tuple[str, str] | None:
        """The same for a principal a session cookie names (it must still exist and not be revoked)."""
        if principal == BOOTSTRAP:
            return (BOOTSTRAP, "admin") if self.bootstrap else None
        if not principal.startswith("t") or not principal[1:].isdigit():
            return None
        return self._cached(principal, lambda s: _row_by_id(s, int(principal[1:])))

    def _cached(self, key: str, query) -> tuple[str, str] | None:
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and now - hit[0] < CACHE_S:
                return hit[1]
        with self.sessionmaker() as session:
            value = query(session)
            session.commit()
        with self._lock:
            if len(self._cache) > 10_000:
                self._cache.clear()
            self._cache[key] = (now, value)
        return value

    def forget(self) -> None:
        with self._lock:
            self._cache.clear()


def _row_by_hash(session, digest: str):
    from backend.models import ApiToken, utcnow

    row = session.query(ApiToken).filter(ApiToken.token_hash == digest, ApiToken.revoked_at.is_(None)).one_or_none()
    if row is None:
        return None
    row.last_used_at = utcnow()
    return f"t{row.id}", row.scope


def _row_by_id(session, token_id: int):
    from backend.models import ApiToken

    row = session.get(ApiToken, token_id)
    return None if row is None or row.revoked_at is not None else (f"t{row.id}", row.scope)


def create_token(session, name: str, scope: str):
    """(row, raw token): a new stored token; the raw value exists only in the return value. ValueError when
    the name is taken or the scope unknown."""
    from backend.models import ApiToken, utcnow

    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {', '.join(SCOPES)}, got {scope!r}")
    if session.query(ApiToken).filter(ApiToken.name == name).first() is not None:
        raise ValueError(f"a token named {name!r} exists already; revoke it or choose another name")
    raw = new_token()
    row = ApiToken(name=name, scope=scope, token_hash=token_hash(raw), prefix=raw[:12], created_at=utcnow())
    session.add(row)
    session.flush()
    return row, raw


# ---------------------------------------------------------------------------------------------------------
# session cookie
def session_key(api_token: str) -> bytes:
    return hmac.new(api_token.encode(), b"plab session cookie v1", hashlib.sha256).digest()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def make_cookie(key: bytes, principal: str, now: float | None = None) -> str:
    payload = _b64(json.dumps({"p": principal, "exp": int((now or time.time()) + SESSION_TTL_S),
                               "n": secrets.token_hex(8)}).encode())
    return payload + "." + _b64(hmac.new(key, payload.encode(), hashlib.sha256).digest())


def read_cookie(key: bytes, value: str) -> str | None:
    """The principal a well-signed, unexpired cookie names, else None."""
    payload, _, sig = value.partition(".")
    expected = _b64(hmac.new(key, payload.encode(), hashlib.sha256).digest())
    if not sig or not hmac.compare_digest(sig, expected):
        return None
    try:
        data = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except (ValueError, json.JSONDecodeError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("p"), str) or not isinstance(data.get("exp"), int):
        return None
    return data["p"] if data["exp"] > time.time() else None


def csrf_token(key: bytes, cookie: str) -> str:
    return _b64(hmac.new(key, b"csrf:" + cookie.encode(), hashlib.sha256).digest())


def cookie_value(headers) -> str | None:
    """The plab_session cookie of a request's headers."""
    for k, v in headers:
        if k != b"cookie":
            continue
        for part in v.decode("latin-1").split(";"):
            name, _, value = part.strip().partition("=")
            if name == COOKIE and value:
                return value
    return None
