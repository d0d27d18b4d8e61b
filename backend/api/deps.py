"""Dependencies injected into routes: the settings, a database session, the write token check."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext
from typing import Annotated

from fastapi import Depends, HTTPException, Path, Query, Request
from sqlalchemy.orm import Session

from backend.db import transaction, write_lock
from plab.settings import Settings

# Ids are 32-bit in the database; larger numbers are refused before they reach it.
ObjectId = Annotated[int, Path(ge=1, le=2**31 - 1)]
# A job's heartbeat names the job (its claim's worker_host): a job that no longer holds its row renews nothing
Holder = Annotated[str | None, Query(max_length=200, description="the job's worker_host, as it claimed the row: a "
                                     "job that no longer holds it renews nothing (the answer names the holder)")]


def refuse_nul_in_url(request: Request) -> None:
    """A NUL character (%00) in a parameter of the URL is refused (422), as the OpenAPI document states (a pattern on
    every string parameter): PostgreSQL cannot compare text with it, so no search or lookup could use it."""
    from fastapi.exceptions import RequestValidationError

    route = request.scope.get("route")
    declared = {p.alias for p in getattr(getattr(route, "dependant", None), "query_params", [])}
    given = [("query", k, v) for k, v in request.query_params.multi_items() if k in declared]
    given += [("path", k, v) for k, v in request.path_params.items() if isinstance(v, str)]
    for where, name, value in given:
        if "\x00" in value:
            raise RequestValidationError([{"loc": (where, name), "type": "value_error",
                                           "msg": "contains a NUL character (%00), which no stored text holds; "
                                                  "remove it"}])


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_session(request: Request) -> Iterator[Session]:
    """A session committed when the route returns. Routes use it with scope="function", so the commit happens
    before the response is sent: a client that reads right after a write sees it. A writing request (any method
    but GET/HEAD) holds the database's write lock (`backend.db.write_lock`) for its transaction."""
    factory = request.app.state.sessionmaker
    writes = request.method not in ("GET", "HEAD", "OPTIONS")
    with write_lock(factory.kw["bind"]) if writes else nullcontext(), transaction(factory) as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session, scope="function")]


def require_write_token(request: Request, settings: Settings = Depends(get_settings)) -> None:
    """With PLAB_API_TOKEN set, every write needs a `write` credential (backend.guard.AuthGate checked it before
    the body was read; this states it for the route and its OpenAPI entry)."""
    if not settings.api_token:
        return
    principal = getattr(request.state, "plab_principal", None)
    if principal is None:
        raise HTTPException(status_code=401, detail="this server requires an API token for writes: send the header "
                            "'Authorization: Bearer <token>'", headers={"WWW-Authenticate": "Bearer"})
    if not principal.allows("write"):
        raise HTTPException(status_code=403, detail=f"this token's scope is '{principal.scope}'; writes need 'write'")


# The `dependencies` of every route that writes.
WRITE = [Depends(require_write_token)]
