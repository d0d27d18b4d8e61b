"""The relative loss difference to BF16, computed on the server, on synthetic series with a
known offset (a recipe whose loss is 1.02 x BF16's differs by +2.00 % everywhere), against real databases."""
from __future__ import annotations

import math

import pytest
from sqlalchemy import text

from backend.services.comparison import relative_difference
from tests.backend.test_api import create, make_client


@pytest.fixture
def api(database_url, tmp_path):
    return make_client(database_url, tmp_path)


def loss(tokens: float) -> float:
    return 2.0 + 8.0 * math.exp(-tokens / 3e5)


def send(api, run_id, points):
    for i in range(0, len(points), 10_000):
        r = api.post(f"/api/v1/runs/{run_id}/metrics", json={"points": points[i:i + 10_000]})
        assert r.status_code == 200, r.text


def curve(n, tokens_per_step, factor=1.0, key="train/loss", start=0):
    return [{"key": key, "step": s, "tokens": (s + 1) * tokens_per_step, "wall_time": 0.1 * s,
             "value": factor * loss((s + 1) * tokens_per_step)} for s in range(start, n)]


def finish(api, run_id, gemm_backend="real", **summary):
    for status in ("running", "succeeded"):
        body = {"status": status, "gemm_backend": gemm_backend}
        if status == "succeeded":
            body["summary"] = summary
        assert api.post(f"/api/v1/runs/{run_id}/status", json=body).status_code == 200


def comparison(api, exp_id, **params):
    r = api.get(f"/api/v1/experiments/{exp_id}/comparison", params=params)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_recipe_at_1_02_times_bf16_is_2_percent_above_everywhere_also_on_another_token_grid(api):
    exp = create(api)
    bf16, fp8, nvfp4 = (r["id"] for r in exp["runs"])
    send(api, bf16, curve(600, 1000))
    send(api, fp8, curve(600, 1000, factor=1.02))
    # nvfp4 logs every 500 tokens (a finer grid holding BF16's): BF16's points are on it, so exact again
    send(api, nvfp4, curve(1200, 500, factor=0.99))
    finish(api, bf16, tokens_per_s=1000.0, mfu=0.30, peak_mem_gib=20.0)
    finish(api, fp8, tokens_per_s=1500.0, mfu=0.45, peak_mem_gib=16.0)
    finish(api, nvfp4, tokens_per_s=800.0, mfu=0.24, gemm_backend="emulated")
    body = comparison(api, exp["id"], key="train/loss", x="tokens")
    assert body["baseline_run_id"] == bf16
    runs = {r["run_id"]: r for r in body["runs"]}
    assert runs[bf16]["is_baseline"] and runs[bf16]["delta_pct"] == []
    f = runs[fp8]
    assert len(f["delta_pct"]) == 600 and f["x"][0] == 1000 and f["x"][-1] == 600_000
    assert all(round(d, 2) == 2.00 for d in f["delta_pct"]), f["delta_pct"][:5]
    n = runs[nvfp4]
    assert n["x"] == f["x"] and all(round(d, 2) == -1.00 for d in n["delta_pct"])
    # the summary next to the curves
    assert f["final_delta_pct"] == pytest.approx(2.0, abs=1e-9)
    assert f["final_loss"] == pytest.approx(sum(1.02 * loss(t * 1000) for t in range(581, 601)) / 20)
    assert f["speedup"] == pytest.approx(1.5) and n["speedup"] == pytest.approx(0.8)
    assert (f["mfu"], f["peak_mem_gib"], f["gemm_backend"], f["emulated"]) == (0.45, 16.0, "real", False)
    assert n["emulated"] and n["gemm_backend"] == "emulated" and n["peak_mem_gib"] is None
    assert runs[bf16]["speedup"] == 1.0


def test_recipe_points_between_bf16_points_are_interpolated_linearly(api):
    exp = create(api)
    bf16, fp8, _ = (r["id"] for r in exp["runs"])
    # a curve linear in tokens, so linear interpolation is exact between any two points
    send(api, bf16, [{"key": "val/loss", "step": s, "tokens": 700 * s, "value": 5.0 - 1e-6 * 700 * s}
                     for s in range(1, 200)])
    send(api, fp8, [{"key": "val/loss", "step": s, "tokens": 1100 * s, "value": 1.02 * (5.0 - 1e-6 * 1100 * s)}
                    for s in range(1, 100)])
    body = comparison(api, exp["id"], key="val/loss")
    f = next(r for r in body["runs"] if r["run_id"] == fp8)
    # only BF16 points inside fp8's token range are compared (no extrapolation)
    assert f["x"] == [700 * s for s in range(2, 156)]
    assert all(abs(d - 2.0) < 1e-9 for d in f["delta_pct"])


def test_long_runs_are_compared_through_bucket_means_with_the_same_offset(api):
    exp = create(api)
    bf16, fp8, _ = (r["id"] for r in exp["runs"])
    send(api, bf16, curve(6000, 64))
    send(api, fp8, curve(6000, 64, factor=1.03))
    body = comparison(api, exp["id"], max_points=200)
    f = next(r for r in body["runs"] if r["run_id"] == fp8)
    assert 100 < len(f["delta_pct"]) <= 200
    assert all(abs(d - 3.0) < 1e-9 for d in f["delta_pct"])


def test_a_live_run_is_bucketed_like_the_finished_baseline_and_has_no_final_difference_yet(api):
    """The same curve, the baseline finished (6000 points, read as 32-step means at max_points=200) and the recipe
    at step 1500 (raw before: its points against the baseline's bucket means, which sit above a convex curve, read
    -0.9% at the start): both are read at one bucket width, so the difference is 0 wherever it is drawn."""
    exp = create(api)
    bf16, fp8, _ = (r["id"] for r in exp["runs"])
    send(api, bf16, curve(6000, 64))
    finish(api, bf16, tokens_per_s=1000.0)
    send(api, fp8, curve(1500, 64))
    assert api.post(f"/api/v1/runs/{fp8}/status", json={"status": "running"}).status_code == 200
    body = comparison(api, exp["id"], max_points=200)
    f = next(r for r in body["runs"] if r["run_id"] == fp8)
    assert len(f["delta_pct"]) > 30
    assert max(abs(d) for d in f["delta_pct"]) < 1e-9, f["delta_pct"][:5]
    # its last 20 points are at step 1500, BF16's at step 6000: no "final" difference while it trains
    assert f["final_loss"] is not None and f["final_delta_pct"] is None
    assert api.post(f"/api/v1/runs/{fp8}/status", json={"status": "succeeded"}).status_code == 200
    f = next(r for r in comparison(api, exp["id"], max_points=200)["runs"] if r["run_id"] == fp8)
    assert f["final_delta_pct"] is not None


def test_unknown_key_gives_empty_curves_and_an_experiment_without_bf16_run_is_a_409(api, database_url):
    exp = create(api)
    bf16 = exp["runs"][0]["id"]
    body = comparison(api, exp["id"], key="no/such/key")
    assert all(r["delta_pct"] == [] and r["final_loss"] is None for r in body["runs"])
    assert "no 'no/such/key' points" in body["note"]
    assert api.get("/api/v1/experiments/999999/comparison").status_code == 404
    bad = api.get(f"/api/v1/experiments/{exp['id']}/comparison?x=wall_time")
    assert bad.status_code == 422 and "x" in bad.json()["detail"]
    # The API always adds a BF16 run; one removed from the database leaves nothing to compare with.
    from backend.db import session_scope

    with session_scope(database_url) as session:
        session.execute(text("DELETE FROM runs WHERE id = :r"), {"r": bf16})
    r = api.get(f"/api/v1/experiments/{exp['id']}/comparison")
    assert r.status_code == 409 and "has no bf16 run" in r.json()["detail"]


def test_comparison_and_accuracy_measure_against_the_experiments_own_baseline(api, database_url):
    from backend.db import session_scope
    from backend.schemas import EvalTaskResultIn, EvaluationStatusUpdate
    from backend.services import evaluations

    exp = create(api)
    bf16, fp8, _ = (r["id"] for r in exp["runs"])
    send(api, bf16, curve(50, 1000))
    send(api, fp8, curve(50, 1000, factor=1.25))
    for run in (bf16, fp8):
        finish(api, run)
        art = api.post(f"/api/v1/runs/{run}/artifacts", json={"kind": "checkpoint", "path": f"/ckpt/{run}"})
        assert art.status_code == 201
    with session_scope(database_url) as session:
        session.execute(text("UPDATE experiments SET baseline = 'fp8_tensorwise' WHERE id = :e"), {"e": exp["id"]})
        for run in (bf16, fp8):  # a finished evaluation per run, as a worker would report it
            ev = evaluations.create_evaluation(session, run, ["plab_blimp"], None)
            for status in ("running", "succeeded"):
                evaluations.update_status(session, ev.id, EvaluationStatusUpdate(status=status))
            evaluations.store_result(session, ev.id, EvalTaskResultIn(task="plab_blimp", result={"metrics": {}}))
    body = comparison(api, exp["id"])
    assert body["baseline_run_id"] == fp8
    b = next(r for r in body["runs"] if r["run_id"] == bf16)
    assert all(round(d, 6) == -20.0 for d in b["delta_pct"])  # 1 / 1.25 of the baseline's loss
    table = api.get(f"/api/v1/experiments/{exp['id']}/accuracy").json()
    assert table["baseline_run_id"] == fp8


def test_relative_difference_validates_and_skips_zero_baseline_losses():
    x, d = relative_difference([1, 2, 3], [0.0, 2.0, 4.0], [1, 3], [1.0, 5.0])
    assert x == [2.0, 3.0] and d == pytest.approx([50.0, 25.0])
    with pytest.raises(ValueError, match="as many x as y"):
        relative_difference([1, 2], [1.0], [1], [1.0])


def test_extreme_values_leave_no_number_the_json_cannot_carry(api):
    """Finite values whose ratio is not (BF16 at 1e-300, a recipe at 1e300 - under the 1e300 ingest cap): the
    comparison leaves those points out instead of failing to encode an infinity (a 500 before)."""
    exp = create(api)
    bf16, fp8, _ = (r["id"] for r in exp["runs"])
    send(api, bf16, [{"key": "train/loss", "step": s, "tokens": 64 * (s + 1), "value": 1e-300} for s in range(30)])
    send(api, fp8, [{"key": "train/loss", "step": s, "tokens": 64 * (s + 1), "value": 1e300} for s in range(30)])
    for run in (bf16, fp8):
        finish(api, run, tokens_per_s=1000.0)
    for params in ({}, {"max_points": 10, "final_n": 1}):
        f = next(r for r in comparison(api, exp["id"], **params)["runs"] if r["run_id"] == fp8)
        assert f["delta_pct"] == [] and f["final_delta_pct"] is None
