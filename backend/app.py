"""The FastAPI application: REST API under /api/v1, the dashboard pages from frontend/."""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sqlalchemy.exc import IntegrityError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from backend.db import session_factory
from backend.services.runs import Conflict, InvalidInput, NotFound
from backend.settings import Settings, get_settings

log = logging.getLogger("plab.api")


def _describe(errors: list[dict]) -> str:
    parts = []
    for e in errors:
        loc = ".".join(str(p) for p in e.get("loc", ()) if p not in ("body", "query", "path"))
        msg = e.get("msg", "invalid")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts) or "invalid request"


def _error(status: int, message: str, **extra) -> JSONResponse:
    return JSONResponse(status_code=status, content={"detail": message, **extra})


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _request_invalid(_req: Request, exc: RequestValidationError):
        errors = [{k: v for k, v in e.items() if k in ("loc", "msg", "type")} for e in exc.errors()]
        return _error(422, _describe(errors), errors=errors)

    @app.exception_handler(ValidationError)
    async def _invalid(_req: Request, exc: ValidationError):
        errors = [{k: v for k, v in e.items() if k in ("loc", "msg", "type")} for e in exc.errors()]
        return _error(422, _describe(errors), errors=errors)

    @app.exception_handler(InvalidInput)
    async def _domain_invalid(_req: Request, exc: InvalidInput):
        return _error(422, str(exc))

    @app.exception_handler(NotFound)
    async def _not_found(_req: Request, exc: NotFound):
        return _error(404, str(exc))

    @app.exception_handler(Conflict)
    async def _conflict(_req: Request, exc: Conflict):
        return _error(409, str(exc))

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
        return _error(exc.status_code, str(exc.detail), **({} if exc.status_code != 404 else {}))


def create_app(settings: Settings | None = None, *, migrate: bool | None = None) -> FastAPI:
    settings = settings or get_settings()
    if migrate if migrate is not None else settings.is_sqlite:
        # The embedded default migrates on start; served deployments run `plab db upgrade`.
        from backend.migrate import upgrade

        upgrade(settings.database_url)
    app = FastAPI(title="Precision Lab", version="0.1.0",
                  description="Low-precision training recipes against a BF16 baseline: experiments, runs, "
                              "metrics, evaluations and GEMM benchmarks.")
    app.state.settings = settings
    app.state.sessionmaker = session_factory(settings.database_url)
    install_error_handlers(app)

    from backend.api.routes import evaluations, experiments, gemm, recipes, runs

    for module in (experiments, runs, gemm, recipes):
        app.include_router(module.router, prefix="/api/v1")
    app.include_router(evaluations.router, prefix="/api/v1")

    @app.get("/api/v1/health", tags=["meta"])
    def health():
        return {"status": "ok", "database": settings.database_url.split(":", 1)[0],
                "auth": bool(settings.api_token)}

    try:
        from frontend import pages
    except ImportError:  # the dashboard is optional for an API-only deployment
        pages = None
    if pages is not None and hasattr(pages, "mount"):
        pages.mount(app)
    return app
