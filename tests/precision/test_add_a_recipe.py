"""Adding a recipe through the catalog alone: a throw-away recipe in a temporary module (its catalog entry) plus
its implementation module, named in PLAB_RECIPE_MODULES, shows up in the API's schema and GET /api/v1/recipes,
the dashboard's recipe lists, the GEMM benchmark's formats, the run spec and apply_recipe - with no edit of the
code that reads the catalog (docs/EXTENDING.md, "How to add a recipe")."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CATALOG_ENTRY = '''
from training.precision.catalog import SCALE_ROUNDINGS, RecipeEntry, RecipeOption, add_recipe

add_recipe(RecipeEntry(
    name="mxfp8_floor", summary="MXFP8 with the OCP spec's floor scale rule", elements="E4M3 for every operand",
    scaling="one E8M0 scale per 32 elements, floor rule", gemm_format="mxfp8_floor",
    real_kernels="torchao MXFP8Linear (floor)", real_min_capability=(10, 0), emulated_elsewhere=True,
    options=(RecipeOption("scale_rounding", "string", "floor", "E8M0 scale rule", choices=SCALE_ROUNDINGS),),
    module="plab_throwaway_impl"))
'''

IMPLEMENTATION = '''
from training.precision.gemm_ops import EmulatedGemmOps, check_divisible
from training.precision.mxfp8 import BLOCK, MXFP8Quantizer, MXFP8Recipe
from training.precision.registry import register


class MXFP8FloorGemmOps(EmulatedGemmOps):
    def check_shape(self, shape):
        check_divisible(shape, self.fmt, BLOCK, "k")


@register
class MXFP8FloorRecipe(MXFP8Recipe):
    name = "mxfp8_floor"

    def gemm_ops(self, device):  # emulated everywhere: training's quantizer and GEMM in both benchmark modes
        rounding = self.resolve_options({})["scale_rounding"]
        return MXFP8FloorGemmOps(self.name, device, self.gemm_error_bound, MXFP8Quantizer(rounding))
'''

CHECKS = textwrap.dedent('''
    import json, sys
    from pathlib import Path
    from tests.backend.test_api import EXPERIMENT, make_client

    home = Path(sys.argv[1])
    api = make_client(f"sqlite:///{home / 'plab.sqlite'}", home)
    out = {
        "openapi": "mxfp8_floor" in api.get("/openapi.json").text,
        "catalog": api.get("/api/v1/recipes").json(),
        "form": '<option value="mxfp8_floor"' in api.get("/experiments/new").text,
        "runs_filter": '"mxfp8_floor"' in api.get("/runs").text,
        "good": api.post("/api/v1/experiments", json={**EXPERIMENT, "recipes": ["mxfp8_floor"]}).status_code,
        "bad": api.post("/api/v1/experiments", json={**EXPERIMENT, "recipes": [
            {"name": "mxfp8_floor", "options": {"scale_rounding": "up"}}]}).json()["detail"],
        "api_imported_torch": sys.modules.get("torch") is not None,
    }
    from training.config import RunSpec
    from training.gemm import FORMATS, run_gemm_benchmark
    from training.model import build_model, llama_config
    from training.precision import RECIPES, apply_recipe

    out["spec"] = RunSpec.from_dict({"recipe": "mxfp8_floor"}, check_paths=False).recipe
    out["recipes"] = list(RECIPES)
    out["gemm_formats"] = list(FORMATS)
    result = run_gemm_benchmark(shapes="64x128x96", formats="mxfp8_floor", device="cpu", repeats=1, warmup=0)
    out["gemm_checks"] = [(r["format"], r["mode"], r["check"]) for r in result["results"]]
    report = apply_recipe(build_model(llama_config("tiny", 256, 32), 0), "mxfp8_floor")
    out["applied"] = [report.gemm_backend, report.options, sum(layer["converted"] for layer in report.layers)]
    print(json.dumps(out))
''')


def test_a_throw_away_recipe_added_through_the_catalog_reaches_every_consumer(tmp_path):
    (tmp_path / "plab_throwaway_catalog.py").write_text(CATALOG_ENTRY)
    (tmp_path / "plab_throwaway_impl.py").write_text(IMPLEMENTATION)
    env = {**os.environ, "PLAB_RECIPE_MODULES": "plab_throwaway_catalog",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", CHECKS, str(tmp_path)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["openapi"] and out["form"] and out["runs_filter"] and not out["api_imported_torch"]
    names = [r["name"] for r in out["catalog"]["recipes"]]
    assert names[-1] == "mxfp8_floor" and names[:-1] == out["recipes"][:-1]
    assert out["catalog"]["gemm_formats"][-1] == "mxfp8_floor" == out["gemm_formats"][-1]
    assert out["good"] == 201
    assert "option scale_rounding of mxfp8_floor must be one of floor, rceil, got 'up'" in out["bad"]
    assert out["spec"] == "mxfp8_floor" and out["recipes"][-1] == "mxfp8_floor"
    assert [c for c in out["gemm_checks"] if c[0] == "mxfp8_floor"] == [["mxfp8_floor", "kernel", "pass"],
                                                                      ["mxfp8_floor", "quant", "pass"]]
    backend, options, converted = out["applied"]
    assert backend == "emulated" and options == {"scale_rounding": "floor"} and converted > 0
