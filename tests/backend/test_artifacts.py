"""Artifacts: one record per (run, kind, path), paths under PLAB_HOME stored relative to it (the folder can
move), and `plab eval --output` never loses a finished evaluation."""
from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from backend.app import create_app
from plab.settings import Settings, home_path, portable_path


def test_the_same_artifact_reported_twice_is_one_record_with_merged_meta(tmp_path, monkeypatch):
    monkeypatch.setenv("PLAB_HOME", str(tmp_path))
    api = TestClient(create_app(Settings(home=tmp_path, database_url=f"sqlite:///{tmp_path / 'p.sqlite'}",
                                         broker_url="filesystem://", api_token=None, data_dir=tmp_path,
                                         api_url="http://test"), migrate=True))
    r = api.post("/api/v1/experiments", json={"name": "a", "training": {"steps": 40}, "enqueue": False})
    assert r.status_code == 201, r.text
    exp = r.json()
    run_id = exp["runs"][0]["id"]
    (tmp_path / "runs/1/checkpoints/step_00000010").mkdir(parents=True)
    path = "runs/1/checkpoints/step_00000010"
    for meta in ({"format": "hf"}, {"final": True}):
        assert api.post(f"/api/v1/runs/{run_id}/artifacts",
                        json={"kind": "checkpoint", "path": path, "step": 10, "meta": meta}).status_code == 201
    arts = api.get(f"/api/v1/runs/{run_id}/artifacts").json()
    assert len(arts) == 1 and arts[0]["meta"] == {"format": "hf", "final": True}
    assert arts[0]["exists"] is True                       # relative: looked up under PLAB_HOME
    monkeypatch.setenv("PLAB_HOME", str(tmp_path / "elsewhere"))
    assert api.get(f"/api/v1/runs/{run_id}/artifacts").json()[0]["exists"] is False


def test_paths_inside_plab_home_are_recorded_relative_to_it(tmp_path):
    home = tmp_path / "home"
    inside = home / "runs" / "3" / "checkpoints" / "step_00000005"
    assert portable_path(inside, home) == "runs/3/checkpoints/step_00000005"
    assert portable_path(tmp_path / "other", home) == str((tmp_path / "other").resolve())
    moved = tmp_path / "moved"
    assert home_path("runs/3/checkpoints/step_00000005", moved) == moved / "runs/3/checkpoints/step_00000005"
    assert home_path("/abs/ckpt", moved) == __import__("pathlib").Path("/abs/ckpt")


def test_plab_eval_output_folder_is_made_first_and_results_survive_a_failed_write(tmp_path, capsys):
    from training.evaluation.cli import _check_output, _write_output

    target = tmp_path / "new" / "deeper" / "results.json"
    _check_output(str(target))
    assert target.parent.is_dir()
    with pytest.raises(OSError, match="is a folder"):
        _check_output(str(tmp_path))
    assert _write_output(str(target), {"tasks": {"x": 1}}) == 0
    assert json.loads(target.read_text()) == {"tasks": {"x": 1}}
    target.parent.chmod(0o500)
    try:
        code = _write_output(str(target.parent / "other.json"), {"tasks": {"y": 2}})
    finally:
        target.parent.chmod(0o700)
    err = capsys.readouterr().err
    if code == 1:  # root may write anyway; otherwise the results went to the fallback file named
        fallback = err.rsplit("the results are in ", 1)[1].strip()
        assert json.loads(open(fallback).read()) == {"tasks": {"y": 2}}
