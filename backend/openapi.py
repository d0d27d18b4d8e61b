"""The OpenAPI document states every answer an operation can give, not only its success: the front door's
401/403/413 (backend/guard.py), 404 for a path naming a missing object, 409 for a state that forbids the request,
503 where a job is sent to the queue, and the error body every failure has
(`{"detail": "<one readable sentence>"}`, backend/errors.py, not FastAPI's list of validation errors)."""
from __future__ import annotations

from fastapi.openapi.utils import get_openapi

from backend import spec_schema
from backend.schemas import METRIC_INGEST, NO_NUL_PATTERN

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
            ("/api/v1/gemm-benchmarks", "post"), ("/api/v1/runs/{run_id}/status", "post"),
            ("/api/v1/runs/{run_id}/retry", "post")}
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
        _request_schemas(app, components)
        _no_nul_strings(schema)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi


def _request_schemas(app, components: dict) -> None:
    """The bodies validated beyond their pydantic types (backend/spec_schema.py builds what each accepts)."""
    from training.evaluation.taskdirs import known_task_names

    from backend.services.runs import spec_roots

    roots = spec_roots()
    names = spec_schema.recipe_names()

    recipe = components["RecipeRequest"]
    recipe["properties"]["name"]["enum"] = names
    recipe["properties"]["seeds"]["anyOf"][0]["uniqueItems"] = True
    recipe["allOf"] = spec_schema.recipe_option_rules("name", "options", name_required=True)

    run = components["RunCreate"]
    run["properties"]["recipe"]["enum"] = names
    run["allOf"] = spec_schema.recipe_option_rules("recipe", "recipe_options", name_required=False)

    components["GemmRequest"] = spec_schema.gemm_request_schema()
    components["GemmResult"] = spec_schema.gemm_result_schema()
    null = {"type": "null"}
    request, result = {"$ref": "#/components/schemas/GemmRequest"}, {"$ref": "#/components/schemas/GemmResult"}
    gemm = components["GemmBenchmarkCreate"]
    gemm["properties"]["request"]["anyOf"] = [request, null]
    gemm["properties"]["result"]["anyOf"] = [result, null]
    gemm["anyOf"] = [{"required": ["request"], "properties": {"request": request, "result": null}},
                     {"required": ["result"], "properties": {"result": result, "request": null}}]
    status = components["GemmStatusUpdate"]
    status["properties"]["result"]["anyOf"] = [result, null]
    status["anyOf"] = [{"required": ["status", "result"], "properties": {"status": {"const": "succeeded"},
                                                                         "result": result}},
                       {"properties": {"status": {"enum": ["running", "failed"]}, "result": null}}]

    exp = components["ExperimentCreate"]
    exp["description"] = ("Rules over several numbers, which JSON Schema cannot state (422 when broken): "
                          + "; ".join(spec_schema.SPEC_RULES))
    props = exp["properties"]
    props["model"] = {**spec_schema.model_schema(roots), "default": props["model"].get("default")}
    props["data"] = spec_schema.data_schema(roots)
    props["training"] = spec_schema.training_schema()
    props["recipes"]["items"]["anyOf"][0]["enum"] = names
    props["eval_tasks"]["items"] = {"type": "string", "enum": sorted(known_task_names()),
                                    "description": "a task lm-eval finds (shipped, PLAB_EVAL_TASKS_DIR, lm-eval's)"}
    props["seeds"]["anyOf"][0]["uniqueItems"] = True
    # an evaluation of a run names its tasks as an experiment's eval_tasks do (checked alike: 422 otherwise)
    evaluation = components["EvaluationCreate"]["properties"]["tasks"]
    evaluation["items"] = {**evaluation["items"], "enum": sorted(known_task_names()),
                           "description": "a task lm-eval finds (shipped, PLAB_EVAL_TASKS_DIR, lm-eval's)"}
    exp["allOf"] = [
        # seeds (a list) or replicates (a count), not both
        {"not": {"properties": {"seeds": {"type": "array"}, "replicates": {"type": "integer"}},
                 "required": ["seeds", "replicates"]}},
        # data.tokenizer "checkpoint" takes model.init_from's tokenizer
        {"if": {"properties": {"data": {"properties": {"tokenizer": {"const": "checkpoint"}},
                                        "required": ["tokenizer"]}}, "required": ["data"]},
         "then": {"properties": {"model": {"type": "object", "required": ["init_from"]}}, "required": ["model"]}},
        # a trained byte-level BPE needs at least 300 tokens (256 bytes, merges, special)
        {"if": {"properties": {"data": {"properties": {"vocab_size": {"maximum": 299}},
                                        "required": ["vocab_size"]}}, "required": ["data"]},
         "then": {"anyOf": [
             {"properties": {"data": {"properties": {"corpus": {"const": "random"}}, "required": ["corpus"]}}},
             {"properties": {"data": {"properties": {"tokenizer": {"not": {"const": "train"}}},
                                      "required": ["tokenizer"]}}},
             {"properties": {"data": {"not": {"required": ["tokenizer"]}},
                             "model": {"type": "object", "required": ["init_from"]}}, "required": ["model"]}]}},
    ]


def _no_nul_strings(schema: dict) -> None:
    """Every string a request body types, and every string parameter, refuses NUL (PostgreSQL text cannot hold it), as
    the document says here; free-form JSON objects may hold any string (json columns store it escaped)."""
    components = schema["components"]["schemas"]
    seen: set[str] = set()

    def walk(node):
        if isinstance(node, list):
            for n in node:
                walk(n)
            return
        if not isinstance(node, dict):
            return
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
            name = ref.rsplit("/", 1)[1]
            if name not in seen:
                seen.add(name)
                walk(components[name])
            return
        types = node.get("type")
        if (types == "string" or (isinstance(types, list) and "string" in types)) and not any(
                k in node for k in ("pattern", "enum", "const", "format", "anyOf")):
            node["pattern"] = NO_NUL_PATTERN
        for key, value in node.items():
            if key in ("properties", "patternProperties") and isinstance(value, dict):
                # Field names, not keywords: a field called "description" (an experiment's) is a schema too.
                for field in value.values():
                    walk(field)
            elif key not in ("enum", "const", "default", "examples", "description"):
                walk(value)

    for operations in schema.get("paths", {}).values():
        for op in operations.values():
            for parameter in op.get("parameters", []):  # backend.api.deps.refuse_nul_in_url
                walk(parameter.get("schema"))
            content = (op.get("requestBody") or {}).get("content", {})
            for media in content.values():
                walk(media.get("schema"))
