"""Fuzz every operation of the OpenAPI schema with all of schemathesis' checks, on SQLite and on PostgreSQL: never
a 5xx, every status code documented, every response (errors included) valid against its schema, content types,
headers, and `positive_data_acceptance`: a request valid by the document is accepted (2xx, or 401/403/404/409 for
what the state decides, e.g. an id that does not exist).

The document states what each body accepts: the run spec's sections, recipe names and their options, evaluation
task names, path confinement, GEMM requests and results (backend/spec_schema.py). A few rules compare numbers of
two fields (a divisibility, a sum, a product), which JSON Schema cannot state; the document states them in words
(`SPEC_RULES`, the GEMM request's description). `stated_rule_broken` below is those rules, written here from the
document; a generated request that breaks one must be refused with 422 and a `detail` naming it, and every other
request goes through every check. One stated rule only the file system can decide (the paths a spec names exist, on
a host that holds the data directory, as here) is decided by the training library's own check of them, and so is the
one only the model decides (each keep_bf16 pattern names one of its layers)."""
from __future__ import annotations

import math

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import positive_data_acceptance

from backend.app import create_app
from backend.migrate import upgrade
from plab.settings import Settings
from training.config import MODEL_PRESETS

GEMM_MAX_TOKENS = 1 << 22


def _layers(model) -> int | None:
    if model is None or isinstance(model, str):
        return MODEL_PRESETS[model or "tiny"]["num_hidden_layers"]
    return model.get("num_hidden_layers")  # a custom model's; a model from a file is checked when built


def _heads_rule(dims: dict, *, even_head_dim: bool) -> str | None:
    heads, kv, head_dim = dims["num_attention_heads"], dims.get("num_key_value_heads"), dims.get("head_dim")
    if heads % (kv or heads):
        return "num_attention_heads must be a multiple of num_key_value_heads"
    if head_dim is None and dims["hidden_size"] % heads:
        return "hidden_size must be divisible by num_attention_heads"
    if even_head_dim and (head_dim or dims["hidden_size"] // heads) % 2:
        return "the head dim must be even"
    return None


def _runs(body: dict) -> int:
    """How many runs an experiment makes: its distinct recipes (BF16 added when missing), each once per seed."""
    seed = body.get("seed", (body.get("seeds") or [0])[0])
    seeds = body.get("seeds") or ([seed + i for i in range(int(body["replicates"]))] if body.get("replicates") else None)
    if seeds is not None and seed not in seeds:
        seeds = [seed, *seeds]
    defaults = {"options": {}, "bf16_first_layers": 0, "bf16_last_layers": 0, "keep_bf16": [], "label": None,
                "seeds": None}
    recipes = [{**defaults, **({"name": r} if isinstance(r, str) else r)} for r in body.get("recipes") or ["bf16"]]
    if not any(r["name"] == "bf16" for r in recipes):
        recipes.insert(0, {**defaults, "name": "bf16"})
    distinct = {repr(sorted((k, repr(v)) for k, v in r.items())): r for r in recipes}.values()
    n = 0
    for r in distinct:
        if r["seeds"] is not None:
            n += len(set(r["seeds"]) | {seed})
        elif seeds is not None and (body.get("replicate") == "all" or (
                r["name"] == "bf16" and not r["bf16_first_layers"] and not r["bf16_last_layers"])):
            n += len(seeds)
        else:
            n += 1
    return n


def _names_what_does_not_exist(body: dict) -> bool:
    """The document's rule on paths (the data directory is on this host), decided as `plab train` decides it: the
    spec's model and data parse without looking at the files, and not when the files are looked at."""
    from training.config import RunSpec, SpecError

    spec = {"model": body.get("model", "tiny"), "data": body.get("data") or {}}
    try:
        RunSpec.from_dict(spec, check_paths=False)
    except SpecError:
        return False  # refused for another reason, which the other rules or the schema say
    try:
        RunSpec.from_dict(spec, check_paths=True)
    except SpecError:
        return True
    return False


def _layer_choice_refused(body: dict) -> bool:
    """The document's rule on keep_bf16 patterns (each must name a linear layer of the model's blocks), decided by
    the training library's own check of a recipe's spec (on the model built on the meta device), as the API decides
    it; a spec refused before that check is another rule's."""
    from training.config import RunSpec, SpecError
    from training.setup import check_layer_choices

    for r in body.get("recipes") or []:
        if not isinstance(r, dict) or not r.get("keep_bf16"):
            continue
        spec = {"model": body.get("model", "tiny"), "data": body.get("data") or {},
                "training": body.get("training") or {}, "recipe": r.get("name"),
                "keep_bf16": r["keep_bf16"], "bf16_first_layers": r.get("bf16_first_layers", 0),
                "bf16_last_layers": r.get("bf16_last_layers", 0)}
        try:
            parsed = RunSpec.from_dict(spec, check_paths=False)
        except SpecError:
            return False
        try:
            check_layer_choices(parsed)
        except SpecError:
            return True
    return False


def stated_rule_broken(case) -> str | None:
    """Which rule of those the document states in words (not in JSON Schema) the request breaks, if any."""
    body = case.body if isinstance(case.body, dict) else {}
    if (case.method, case.path) == ("POST", "/api/v1/experiments"):
        model, data, t = body.get("model"), body.get("data") or {}, body.get("training") or {}
        layers = _layers(model)
        for r in body.get("recipes") or []:
            if isinstance(r, dict) and layers is not None and \
                    r.get("bf16_first_layers", 0) + r.get("bf16_last_layers", 0) > layers:
                return "bf16_first_layers + bf16_last_layers must not exceed the model's layers"
        if isinstance(model, dict) and "hidden_size" in model:
            broken = _heads_rule(model, even_head_dim=True)
            if broken:
                return broken
            if model.get("vocab_size") is not None and data.get("corpus") != "random" and \
                    data.get("tokenizer", "train") == "train" and model["vocab_size"] < data.get("vocab_size", 2048):
                return "model.vocab_size must not be smaller than data.vocab_size"
        if _runs(body) > 256:
            return "at most 256 runs (recipes x seeds) in one experiment"
        if _names_what_does_not_exist(body):
            return "the files a spec names must exist where the API holds the data directory"
        if _layer_choice_refused(body):
            return "each keep_bf16 pattern must match a linear layer of the model's blocks"
        batch = t.get("batch_size", 8)
        if batch % (t.get("grad_accum", 1) * t.get("gpus", 1) * t.get("nodes", 1)):
            return "batch_size must be divisible by grad_accum x gpus x nodes"
        if t.get("steps") is not None:
            steps = t["steps"]
        elif t.get("tokens") is not None:
            steps = math.ceil(t["tokens"] / (batch * data.get("seq_len", 128)))
        else:
            steps = 200
        if t.get("warmup_steps", 20) > steps:
            return "warmup_steps must not exceed the run's steps"
    if case.method == "POST" and case.path in ("/api/v1/gemm-benchmarks",
                                               "/api/v1/gemm-benchmarks/{benchmark_id}/status"):
        request = body.get("request") or (body.get("result") or {}).get("request") or {}
        if request.get("micro_batch", 4) * request.get("seq_len", 2048) > GEMM_MAX_TOKENS:
            return "micro_batch x seq_len must be at most 2^22 tokens"
        if isinstance(request.get("model"), dict):
            return _heads_rule(request["model"], even_head_dim=False)
    return None


def _app(home, url):
    upgrade(url)
    app = create_app(Settings(home=home, database_url=url, broker_url="filesystem://", api_token=None,
                              data_dir=home, api_url="http://test"), migrate=False)
    # Something to find, so that paths with ids reach past the 404 branch.
    from fastapi.testclient import TestClient

    c = TestClient(app)
    exp = c.post("/api/v1/experiments", json={"name": "seed", "training": {"steps": 50}, "enqueue": False}).json()
    c.post(f"/api/v1/runs/{exp['runs'][0]['id']}/metrics",
           json={"points": [{"key": "train/loss", "step": s, "value": 1.0 / (s + 1)} for s in range(50)]})
    return app


def test_every_operation_answers_as_its_document_says(database_url, tmp_path):
    schema = schemathesis.openapi.from_asgi("/openapi.json", _app(tmp_path, database_url))
    # One hypothesis run per operation (schemathesis' pytest plugin does not support pytest 9 yet).
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 40
    refused = []
    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case):
            response = case.call()
            broken = stated_rule_broken(case)
            if broken is None:
                case.validate_response(response)
            else:  # a rule the document states in words: refused, with the rule named
                case.validate_response(response, excluded_checks=[positive_data_acceptance])
                if response.status_code not in (404, 409):  # the state answers first (e.g. a missing experiment)
                    assert response.status_code == 422, (broken, case.body, response.text[:500])
                    refused.append(broken)
            assert response.status_code < 500, (case.method, case.formatted_path, case.body, response.text[:500])
            if response.status_code >= 400:
                detail = response.json().get("detail")
                assert isinstance(detail, str) and detail, response.text

        check()


def test_every_string_a_request_body_types_states_that_it_refuses_nul(tmp_path):
    """What the fuzzing above finds only when it happens to draw a NUL, checked for every field: each string a request
    body or a parameter types carries a pattern (or enum/const/format) that excludes U+0000, the API's rule. A field
    whose name is also a JSON Schema keyword (an experiment's `description`) was once left without one: the document
    allowed a NUL that the API refused with 422 (schemathesis' positive-data check failed on PostgreSQL)."""
    import re

    schema = _app(tmp_path, f"sqlite:///{tmp_path / 'plab.sqlite'}").openapi()
    components = schema["components"]["schemas"]
    found: list[str] = []

    def walk(node, where: str, seen: frozenset):
        if isinstance(node, list):
            for i, n in enumerate(node):
                walk(n, f"{where}[{i}]", seen)
            return
        if not isinstance(node, dict):
            return
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
            name = ref.rsplit("/", 1)[1]
            if name not in seen:
                walk(components[name], name, seen | {name})
            return
        types = node.get("type")
        if types == "string" or (isinstance(types, list) and "string" in types):
            stated = any(k in node for k in ("enum", "const", "format", "anyOf"))
            pattern = node.get("pattern")
            if not stated and (pattern is None or re.search(pattern, "a\x00b")):
                found.append(where)
        for key, value in node.items():
            if key in ("properties", "patternProperties") and isinstance(value, dict):
                for field, sub in value.items():
                    walk(sub, f"{where}.{field}", seen)
            elif key not in ("enum", "const", "default", "examples", "description", "title"):
                walk(value, where, seen)

    for path, operations in schema["paths"].items():
        for method, op in operations.items():
            for parameter in op.get("parameters", []):
                walk(parameter.get("schema"), f"{method.upper()} {path} {parameter['name']}", frozenset())
            for media in (op.get("requestBody") or {}).get("content", {}).values():
                walk(media.get("schema"), f"{method.upper()} {path}", frozenset())
    assert found == []
    body = components["ExperimentCreate"]["properties"]["description"]
    assert body.get("pattern") and not re.search(body["pattern"], "a\x00b")
