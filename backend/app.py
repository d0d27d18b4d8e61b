"""The FastAPI application: REST API under /api/v1, the dashboard pages from frontend/."""
from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI

from backend.db import session_factory
from backend.errors import install_error_handlers
from backend.guard import AuthGate, SecurityHeaders
from plab.settings import Settings, get_settings


@asynccontextmanager
async def _lifespan(app: FastAPI):
    """The reconciler (backend/services/reconcile.py) runs while the server serves."""
    from backend.services.reconcile import start_reconciler

    stop = start_reconciler(app)
    yield
    if stop is not None:
        stop.set()


def create_app(settings: Settings | None = None, *, migrate: bool | None = None) -> FastAPI:
    settings = settings or get_settings()
    if migrate if migrate is not None else settings.is_sqlite:
        # The embedded default migrates on start; served deployments run `plab db upgrade`.
        from backend.migrate import upgrade

        upgrade(settings.database_url)
    from fastapi import Depends

    from backend.api.deps import refuse_nul_in_url

    app = FastAPI(title="Precision Lab", version="0.1.0", lifespan=_lifespan, dependencies=[Depends(refuse_nul_in_url)],
                  description="Low-precision training recipes against a BF16 baseline: experiments, runs, "
                              "metrics, evaluations and GEMM benchmarks.")
    app.state.settings = settings
    app.state.sessionmaker = session_factory(settings.database_url)
    install_error_handlers(app)
    from backend import openapi

    openapi.install(app)

    from backend.api.routes import auth, evaluations, experiments, gemm, recipes, runs, workers

    for module in (experiments, runs, gemm, recipes, auth, workers):
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
    # Outermost last: security headers on every answer, the credential and size checks before any parsing.
    from backend.auth import TokenStore

    app.state.tokens = TokenStore(app.state.sessionmaker, settings.api_token)
    app.add_middleware(AuthGate, settings=settings, tokens=app.state.tokens)
    app.add_middleware(SecurityHeaders)
    return app
