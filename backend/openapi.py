"""The OpenAPI document states every answer an operation can give, not only its success: the front door's
401/403/413 (backend/guard.py), 404 for a path naming a missing object, 409 for a state that forbids the request,
503 where a job is sent to the queue, and the error body every failure has
(`{"detail": "<one readable sentence>"}`, backend/errors.py, not FastAPI's list of validation errors)."""
from __future__ import annotations

from fastapi.openapi.utils import get_openapi

from backend.schemas import METRIC_INGEST

RAW_BODIES = {"MetricIngest": METRIC_INGEST}

ERROR_SCHEMA = {"type": "object", "required": ["detail"], "properties": {"detail": {"type": "string"}},
                "title": "Error"}
GUARD = {"401": "no credential, or one that is malformed, unknown or revoked (when the server has a token)",
         "403": "the credential's scope is too narrow, or a cookie write without X-CSRF-Token"}
BODY = {"413": "the request body is over PLAB_MAX_BODY_BYTES"}
INVALID = {"422": "the input breaks a rule of the schema or of the domain; `detail` says which and how to fix it"}
MISSING = {"404": "the object the path names does not exist"}
STATE = {"409": "the object's state does not allow it (e.g. a run that has ended, a transition not allowed)"}
QUEUE = {"503": "stored, but the job queue refused the job: `detail` says what was stored and what to do"}
# Operations that send jobs to the workers (backend/services/dispatch.py).
DISPATCH = {("/api/v1/experiments", "post"), ("/api/v1/runs/{run_id}/evaluations", "post"),
            ("/api/v1/gemm-benchmarks", "post"), ("/api/v1/runs/{run_id}/status", "post")}
OPEN = {"/api/v1/health"}
# Creations whose body names an existing object (the experiment of a run or a benchmark).
REFERS = {("/api/v1/runs", "post"), ("/api/v1/gemm-benchmarks", "post")}


def _error(description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


def install(app) -> None:
    def openapi():
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components["Error"] = ERROR_SCHEMA
        # Bodies a route validates itself from the raw bytes (POST /runs/{id}/metrics) name their schema here.
        for name, adapter in RAW_BODIES.items():
            body = adapter.json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[name] = body
        for path, operations in schema.get("paths", {}).items():
            for method, op in operations.items():
                responses = op.setdefault("responses", {})
                extra = {}
                if path not in OPEN:
                    extra.update(GUARD)
                if method in ("post", "put", "patch"):
                    extra.update(BODY)
                if op.get("parameters") or op.get("requestBody"):
                    extra.update(INVALID)
                if "{" in path or (path, method) in REFERS:
                    extra.update(MISSING)
                if "{" in path:
                    extra.update(STATE)
                if (path, method) in DISPATCH:
                    extra.update(QUEUE)
                for code, description in extra.items():
                    documented = responses.get(code, {})
                    responses[code] = _error(documented.get("description") or description)
        for name in ("HTTPValidationError", "ValidationError"):
            schema["components"]["schemas"].pop(name, None)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
