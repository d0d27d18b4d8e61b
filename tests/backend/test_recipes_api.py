"""The recipe catalog at the API: GET /api/v1/recipes, and recipe options refused at submission with a 422 that
says what is wrong, without the API importing torch."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.backend.test_api import EXPERIMENT, make_client
from training.precision import catalog

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def api(tmp_path):
    return make_client(f"sqlite:///{tmp_path / 'plab.sqlite'}", tmp_path)


def test_recipes_endpoint_answers_the_catalog_in_its_documented_shape(api):
    r = api.get("/api/v1/recipes")
    assert r.status_code == 200
    body = r.json()
    assert body == catalog.catalog_dict()
    assert body["baseline"] == "bf16"
    assert [x["name"] for x in body["recipes"]] == list(catalog.recipe_names())
    assert body["gemm_formats"] == list(catalog.gemm_formats())
    mxfp8 = next(x for x in body["recipes"] if x["name"] == "mxfp8")
    assert mxfp8["options"][0]["choices"] == ["floor", "rceil"] and mxfp8["real_min_capability"] == [10, 0]
    assert "/api/v1/recipes" in api.get("/openapi.json").json()["paths"]


@pytest.mark.parametrize("recipe, message", [
    ({"name": "nvfp4", "options": {"rht": "yes"}}, "option rht of nvfp4 must be true or false, got 'yes'"),
    ({"name": "mxfp8", "options": {"scale_rounding": "up"}}, "option scale_rounding of mxfp8 must be one of floor, rceil"),
    ({"name": "fp8_delayed", "options": {"amax_history_len": 0}}, "must be a positive integer, got 0"),
    ({"name": "nvfp4", "options": {"hadamard": True}}, "unknown option(s) hadamard for recipe 'nvfp4'"),
])
def test_bad_recipe_options_are_refused_at_submission_with_what_is_allowed(api, recipe, message):
    r = api.post("/api/v1/experiments", json={**EXPERIMENT, "recipes": [recipe]})
    assert r.status_code == 422, r.text
    assert message in r.json()["detail"]
    assert api.get("/api/v1/experiments").json()["total"] == 0


def test_good_options_are_stored_as_given(api):
    r = api.post("/api/v1/experiments", json={**EXPERIMENT, "recipes": [{"name": "nvfp4", "options": {"rht": False}}]})
    assert r.status_code == 201, r.text
    run = next(x for x in r.json()["runs"] if x["recipe"] == "nvfp4")
    assert api.get(f"/api/v1/runs/{run['id']}").json()["spec"]["recipe_options"] == {"rht": False}


def test_an_external_run_with_bad_options_is_refused(api):
    exp = api.post("/api/v1/experiments", json=EXPERIMENT).json()
    r = api.post("/api/v1/runs", json={"experiment_id": exp["id"], "recipe": "fp8_delayed",
                                       "recipe_options": {"amax_history_len": "long"}})
    assert r.status_code == 422 and "option amax_history_len of fp8_delayed must be" in r.json()["detail"]
    r = api.post("/api/v1/runs", json={"experiment_id": exp["id"], "recipe": "fp9"})
    assert r.status_code == 422 and "unknown recipe 'fp9'" in r.json()["detail"]


def test_the_api_validates_recipes_without_importing_torch(tmp_path):
    code = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None  # any import of torch now fails
        from tests.backend.test_api import EXPERIMENT, make_client
        from pathlib import Path
        api = make_client("sqlite:///{tmp_path / 'plab.sqlite'}", Path({str(tmp_path)!r}))
        bad = api.post("/api/v1/experiments", json={{**EXPERIMENT, "recipes": [{{"name": "nvfp4", "options": {{"rht": "yes"}}}}]}})
        good = api.post("/api/v1/experiments", json={{**EXPERIMENT, "recipes": [{{"name": "nvfp4", "options": {{"rht": False}},
                                                                            "bf16_last_layers": 1}}]}})
        listed = api.get("/api/v1/recipes")
        page = api.get("/experiments/new")
        print(bad.status_code, good.status_code, listed.status_code, page.status_code)
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["422", "201", "200", "200"]


def test_the_new_experiment_form_offers_every_catalog_recipe(api):
    html = api.get("/experiments/new").text
    for name in catalog.recipe_names():
        if name != catalog.BASELINE:
            assert f'<option value="{name}"' in html, name


@pytest.mark.parametrize("recipe, perf, refused", [
    ({"name": "mxfp8", "keep_bf16": ["*.mlp.gate"]}, {}, "keep_bf16 pattern(s) ['*.mlp.gate'] match no linear layer "
                                                         "of the model's blocks; names look like "
                                                         "['layers.0.self_attn.q_proj', "),
    ({"name": "mxfp8", "keep_bf16": ["*.mlp.gate_proj", "layers.1.*"]}, {}, None),
    ({"name": "nvfp4", "keep_bf16": ["*.qkv_proj"]}, {}, "keep_bf16 pattern(s) ['*.qkv_proj'] match no linear layer"),
    ({"name": "nvfp4", "keep_bf16": ["*.qkv_proj"]}, {"fuse_qkv": True}, None),
    ({"name": "nvfp4", "keep_bf16": ["*.q_proj"]}, {"fuse_qkv": True},
     "keep_bf16 pattern(s) ['*.q_proj'] match no linear layer of the model's blocks; names look like "
     "['layers.0.self_attn.o_proj', 'layers.0.self_attn.qkv_proj', "),
])
def test_a_keep_bf16_rule_naming_no_layer_is_refused_when_submitted(api, recipe, perf, refused):
    # Before 2026-12-07 it failed the run when a worker started it (maybe hours later, behind a queue).
    r = api.post("/api/v1/experiments", json={**EXPERIMENT, "training": {"steps": 20, "perf": perf},
                                              "recipes": [recipe]})
    if refused is None:
        assert r.status_code == 201, r.text
    else:
        assert r.status_code == 422 and f"the run spec of recipe {recipe['name']}: {refused}" in r.json()["detail"], \
            r.text
