"""The API's errors in one place: the domain exceptions services raise, and how each is answered.

Every error answer is JSON `{"detail": "<what was wrong and how to fix it>", ...}`: 4xx for a request the client
can correct, 503 when a service the API depends on (the database, the job queue) is down.
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sqlalchemy.exc import IntegrityError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("plab.api")


class InvalidInput(ValueError):
    """Input that passed the schema but not the domain rules (answered with 422)."""


class NotFound(LookupError):
    """A referenced object that does not exist (answered with 404)."""


class Forbidden(PermissionError):
    """A request for something the API never hands out, whoever asks (answered with 403)."""


class Conflict(RuntimeError):
    """A request that contradicts the stored state (answered with 409)."""


class QueueUnavailable(RuntimeError):
    """A job was stored but the job queue refused it (answered with 503); `stored` names what was stored."""

    def __init__(self, message: str, *, stored: dict):
        super().__init__(message)
        self.stored = stored


def _describe(errors: list[dict]) -> str:
    parts = []
    for e in errors:
        loc = ".".join(str(p) for p in e.get("loc", ()) if p not in ("body", "query", "path"))
        msg = e.get("msg", "invalid")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts) or "invalid request"


def _error(status: int, message: str, **extra) -> JSONResponse:
    return JSONResponse(status_code=status, content={"detail": message, **extra})


def _validation_error(exc: RequestValidationError | ValidationError) -> JSONResponse:
    errors = [{k: v for k, v in e.items() if k in ("loc", "msg", "type")} for e in exc.errors()]
    return _error(422, _describe(errors), errors=errors)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _request_invalid(_req: Request, exc: RequestValidationError):
        return _validation_error(exc)

    @app.exception_handler(ValidationError)
    async def _invalid(_req: Request, exc: ValidationError):
        return _validation_error(exc)

    @app.exception_handler(InvalidInput)
    async def _domain_invalid(_req: Request, exc: InvalidInput):
        return _error(422, str(exc))

    @app.exception_handler(NotFound)
    async def _not_found(_req: Request, exc: NotFound):
        return _error(404, str(exc))

    @app.exception_handler(Forbidden)
    async def _forbidden(_req: Request, exc: Forbidden):
        return _error(403, str(exc))

    @app.exception_handler(Conflict)
    async def _conflict(_req: Request, exc: Conflict):
        return _error(409, str(exc))

    @app.exception_handler(QueueUnavailable)
    async def _queue_down(_req: Request, exc: QueueUnavailable):
        log.error("job queue unavailable: %s", exc)
        return _error(503, str(exc), stored=exc.stored)

    @app.exception_handler(IntegrityError)
    async def _integrity(_req: Request, exc: IntegrityError):
        log.warning("integrity error: %s", exc)
        return _error(409, "the request conflicts with stored data (a referenced object is missing or a unique "
                           "key is taken)")

    @app.exception_handler(OperationalError)
    async def _db_down(_req: Request, exc: OperationalError):
        log.error("database error: %s", exc)
        return _error(503, "the database is unavailable; try again shortly")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail))
