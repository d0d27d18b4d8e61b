"""GET /runs/{id}/numerics: every layer's series of one statistic in one answer, in layer order."""
from __future__ import annotations

from tests.backend.test_api import create, make_client


def test_every_layer_of_a_statistic_comes_in_one_answer_in_layer_order(tmp_path):
    api = make_client(f"sqlite:///{tmp_path / 'plab.sqlite'}", tmp_path)
    run = create(api)["runs"][1]
    points = [{"key": f"numerics/layers.{i}.mlp.down/{stat}", "step": step, "value": i + step / 100}
              for i in (10, 2, 1) for stat in ("underflow_frac", "snr_db") for step in (0, 5, 10)]
    points.append({"key": "train/loss", "step": 0, "value": 3.0})
    assert api.post(f"/api/v1/runs/{run['id']}/metrics", json={"points": points}).status_code == 200
    body = api.get(f"/api/v1/runs/{run['id']}/numerics", params={"stat": "snr_db"}).json()
    assert body["stat"] == "snr_db"
    assert [layer["layer"] for layer in body["layers"]] == [f"layers.{i}.mlp.down" for i in (1, 2, 10)]
    assert body["layers"][2]["step"] == [0, 5, 10] and body["layers"][2]["value"] == [10.0, 10.05, 10.1]
    assert api.get(f"/api/v1/runs/{run['id']}/numerics", params={"stat": "../x"}).status_code == 422
    assert api.get("/api/v1/runs/99999/numerics").status_code == 404
