"""Signing in (the dashboard's session cookie) and scoped API tokens; backend/auth.py says how they work."""
from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, HTTPException, Request, Response
from pydantic import BaseModel, Field

from backend import auth
from backend.api.deps import ObjectId, SessionDep
from backend.errors import NotFound
from backend.models import ApiToken, utcnow

router = APIRouter(tags=["auth"])


class SessionOut(BaseModel):
    auth_required: bool = Field(description="whether this server asks for a token (PLAB_API_TOKEN is set)")
    authenticated: bool
    scope: Literal["read", "write", "admin"] | None = None
    csrf: str | None = Field(None, description="send as X-CSRF-Token with every write made with the cookie")


class TokenIn(BaseModel):
    model_config = {"extra": "forbid"}
    name: str = Field(min_length=1, max_length=auth.TOKEN_NAME_MAX, pattern=auth.TOKEN_NAME_PATTERN)
    scope: Literal["read", "write", "admin"]


class TokenOut(BaseModel):
    id: int
    name: str
    scope: str
    prefix: str
    created_at: str
    last_used_at: str | None
    revoked_at: str | None


class TokenCreated(TokenOut):
    token: str = Field(description="the token itself: shown this once, only its hash is kept")


def _settings(request: Request):
    return request.app.state.settings


def _session_out(request: Request, principal, cookie: str | None) -> SessionOut:
    key = auth.session_key(_settings(request).api_token)
    return SessionOut(auth_required=True, authenticated=True, scope=principal.scope,
                      csrf=auth.csrf_token(key, cookie) if cookie else None)


@router.post("/session", response_model=SessionOut, responses={401: {"description": "no valid bearer token"}})
def sign_in(request: Request, response: Response):
    """Trade the bearer token of this request for an HttpOnly, SameSite=Strict session cookie (the dashboard
    keeps no token in the page). Any scope may sign in; the cookie carries that scope."""
    settings = _settings(request)
    if not settings.api_token:
        return SessionOut(auth_required=False, authenticated=False)
    principal = getattr(request.state, "plab_principal", None)
    if principal is None or principal.via != "bearer":
        raise HTTPException(401, "send the token to sign in with as 'Authorization: Bearer <token>'",
                            headers={"WWW-Authenticate": "Bearer"})
    cookie = auth.make_cookie(auth.session_key(settings.api_token), principal.token)
    response.set_cookie(auth.COOKIE, cookie, max_age=auth.SESSION_TTL_S, httponly=True, samesite="strict",
                        secure=request.url.scheme == "https", path="/")
    return _session_out(request, principal, cookie)


@router.get("/session", response_model=SessionOut)
def current_session(request: Request):
    """Whether this browser is signed in, with which scope, and the CSRF value its writes must send."""
    if not _settings(request).api_token:
        return SessionOut(auth_required=False, authenticated=False)
    principal = getattr(request.state, "plab_principal", None)
    if principal is None:
        return SessionOut(auth_required=True, authenticated=False)
    return _session_out(request, principal, auth.cookie_value(request.scope["headers"]) if principal.via == "cookie"
                        else None)


@router.delete("/session", status_code=204)
def sign_out(request: Request):
    """Forget the session cookie in this browser."""
    response = Response(status_code=204)
    response.delete_cookie(auth.COOKIE, path="/", httponly=True, samesite="strict")
    return response


def _out(row: ApiToken) -> dict:
    iso = lambda t: t.isoformat() if t is not None else None  # noqa: E731
    return {"id": row.id, "name": row.name, "scope": row.scope, "prefix": row.prefix,
            "created_at": iso(row.created_at), "last_used_at": iso(row.last_used_at), "revoked_at": iso(row.revoked_at)}


@router.post("/tokens", response_model=TokenCreated, status_code=201,
             responses={409: {"description": "the name is taken"}})
def new_token(body: TokenIn, session: SessionDep):
    """A scoped token (admin only). The response is the only time the token is shown."""
    try:
        row, raw = auth.create_token(session, body.name, body.scope)
    except ValueError as e:
        raise HTTPException(409, str(e)) from e
    return {**_out(row), "token": raw}


@router.get("/tokens", response_model=list[TokenOut])
def list_tokens(session: SessionDep):
    """Every stored token, revoked ones included (admin only); never the tokens themselves."""
    return [_out(row) for row in session.query(ApiToken).order_by(ApiToken.id)]


@router.delete("/tokens/{token_id}", status_code=204, responses={404: {"description": "no such token"}})
def revoke_token(token_id: ObjectId, request: Request, session: SessionDep):
    """Revoke a token (admin only): it stops working within a few seconds, its sessions too."""
    row = session.get(ApiToken, token_id)
    if row is None:
        raise NotFound(f"token {token_id} not found")
    if row.revoked_at is None:
        row.revoked_at = utcnow()
    request.app.state.tokens.forget()
    return Response(status_code=204)
