"""Fuzz every operation of the OpenAPI schema with schemathesis' checks: never a 5xx, every status code
documented, every response (errors included) valid against its schema, content types, headers, negative data
rejected. Excluded: `positive_data_acceptance` (a schema-valid request must be accepted), because the API also
enforces rules its JSON Schema does not state: no NUL character inside free-form JSON (PostgreSQL cannot store
it), cross-field rules (x_min <= x_max, exactly one of request/result), names checked against the catalog and
the task directory. Those answers are 422s with a `detail` that says what to fix (checked below)."""
from __future__ import annotations

import pytest
import schemathesis
from schemathesis.checks import positive_data_acceptance
from hypothesis import HealthCheck, given, settings

from backend.app import create_app
from backend.migrate import upgrade
from plab.settings import Settings


@pytest.fixture(scope="module")
def fuzz_app(tmp_path_factory):
    home = tmp_path_factory.mktemp("fuzz")
    url = f"sqlite:///{home / 'plab.sqlite'}"
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


@pytest.fixture(scope="module")
def fuzz_schema(fuzz_app):
    return schemathesis.openapi.from_asgi("/openapi.json", fuzz_app)


def test_no_operation_answers_with_a_server_error(fuzz_schema):
    # One hypothesis run per operation (schemathesis' pytest plugin does not support pytest 9 yet).
    operations = [result.ok() for result in fuzz_schema.get_all_operations()]
    assert len(operations) >= 12
    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case):
            response = case.call()
            case.validate_response(response, excluded_checks=[positive_data_acceptance])
            assert response.status_code < 500, (case.method, case.formatted_path, case.body, response.text[:500])
            if response.status_code >= 400:
                detail = response.json().get("detail")
                assert isinstance(detail, str) and detail, response.text

        check()
