"""The GEMM benchmark wired into the product: stored through the API, run by `plab gemm-bench --post`
against a real server, and by the Celery task on a real worker."""
from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from backend.app import create_app
from backend.migrate import upgrade
from backend.services.gemm import REQUEST_KEYS
from plab.settings import Settings
from training.gemm import run_gemm_benchmark
from workers.client import json_safe

REPO = Path(__file__).resolve().parents[2]
TOKEN = "gemm-test-token"
TINY_SHAPES = "64x128x96"


@pytest.fixture(scope="module")
def cpu_result() -> dict:
    """A real benchmark result: one tiny GEMM on the CPU, BF16 plus FP8 on torch's CPU kernel and an emulated
    format."""
    return run_gemm_benchmark(shapes=TINY_SHAPES, formats=["bf16", "fp8_tensorwise", "nvfp4"], device="cpu",
                              repeats=2, warmup=0, compile_quant=False)


def make_client(tmp_path: Path, token: str | None = None, url: str | None = None) -> TestClient:
    url = url or f"sqlite:///{tmp_path / 'plab.sqlite'}"
    upgrade(url)
    app = create_app(Settings(home=tmp_path, database_url=url, broker_url="filesystem://", api_token=token,
                              data_dir=tmp_path, api_url="http://test"), migrate=False)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return TestClient(app, headers=headers)


@pytest.fixture
def api(tmp_path) -> TestClient:
    return make_client(tmp_path)


def experiment(api: TestClient) -> int:
    r = api.post("/api/v1/experiments", json={"name": "gemm", "training": {"steps": 50}, "enqueue": False})
    assert r.status_code == 201, r.text
    return r.json()["id"]


# ---------------------------------------------------------------- requests
def test_the_accepted_request_keys_are_exactly_run_gemm_benchmarks_keyword_arguments():
    params = set(inspect.signature(run_gemm_benchmark).parameters) - {"progress"}
    assert set(REQUEST_KEYS) == params


def test_a_queued_request_is_stored_with_every_default_filled_in_and_that_request_runs(api, tmp_path):
    r = api.post("/api/v1/gemm-benchmarks", json={"request": {"shapes": TINY_SHAPES, "formats": ["bf16", "mxfp8"],
                                                              "device": "cpu", "repeats": 1, "warmup": 0},
                                                  "name": "tiny", "enqueue": False})
    assert r.status_code == 201, r.text
    bench = r.json()
    assert bench["status"] == "queued" and bench["name"] == "tiny" and bench["result"] == {}
    assert set(bench["request"]) == set(REQUEST_KEYS)
    # What a worker does with it: the stored request is a complete, valid call.
    result = run_gemm_benchmark(**bench["request"])
    assert {(x["format"], x["mode"]) for x in result["results"]} == {("bf16", "both"), ("mxfp8", "kernel"),
                                                                    ("mxfp8", "quant")}


@pytest.mark.parametrize("request_body, message", [
    ({"model": "tiny", "shapes": "8x8x8"}, "exactly one of 'model'"),
    ({}, "exactly one of 'model'"),
    ({"model": "7b"}, "unknown preset '7b'"),
    ({"model": {"hidden_size": 64}}, "lacks intermediate_size"),
    ({"model": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 3,
                "vocab_size": 100}}, "give head_dim explicitly"),
    ({"shapes": "64x0x8"}, "zero dimension"),
    ({"shapes": "64by8"}, "bad GEMM shape"),
    ({"shapes": "8x8x8", "vocab_size": 100}, "does not apply to 'shapes'"),
    ({"model": "tiny", "formats": ["fp4"]}, "unknown ['fp4']"),
    ({"model": "tiny", "modes": ["fast"]}, "unknown ['fast']"),
    ({"model": "tiny", "micro_batch": 0}, "micro_batch must be an integer"),
    ({"model": "tiny", "micro_batch": 4096, "seq_len": 4096}, "lower one of them"),
    ({"model": "tiny", "repeats": 1.5}, "repeats must be an integer"),
    ({"model": "tiny", "device": "tpu"}, "device must be auto, cpu, cuda or cuda:N"),
    ({"model": "tiny", "bf16_step_time_s": -1}, "bf16_step_time_s must be positive"),
    ({"model": "tiny", "gated_mlp": "yes"}, "gated_mlp must be true or false"),
    ({"model": "tiny", "progress": "x"}, "unknown keys ['progress']"),
])
def test_a_request_run_gemm_benchmark_would_refuse_is_answered_422_with_what_to_fix(api, request_body, message):
    r = api.post("/api/v1/gemm-benchmarks", json={"request": request_body, "enqueue": False})
    assert r.status_code == 422, r.text
    assert message in r.json()["detail"]
    assert api.get("/api/v1/gemm-benchmarks").json()["total"] == 0


def test_a_body_needs_exactly_one_of_request_or_result_and_an_existing_experiment(api, cpu_result):
    both = api.post("/api/v1/gemm-benchmarks", json={"request": {"model": "tiny"}, "result": cpu_result})
    assert both.status_code == 422 and "exactly one of 'request'" in both.json()["detail"]
    neither = api.post("/api/v1/gemm-benchmarks", json={"name": "x"})
    assert neither.status_code == 422
    missing = api.post("/api/v1/gemm-benchmarks", json={"result": cpu_result, "experiment_id": 999})
    assert missing.status_code == 404 and "experiment 999" in missing.json()["detail"]


def test_a_foreign_json_is_not_taken_for_a_benchmark_result(api, cpu_result):
    r = api.post("/api/v1/gemm-benchmarks", json={"result": {"results": []}})
    assert r.status_code == 422 and "plab.gemm_bench/1" in r.json()["detail"]
    broken = {**cpu_result, "request": {**cpu_result["request"], "formats": ["fp4"]}}
    r = api.post("/api/v1/gemm-benchmarks", json={"result": broken})
    assert r.status_code == 422 and "request.formats" in r.json()["detail"]


# ---------------------------------------------------------------- results and listing
def test_a_posted_result_is_stored_as_succeeded_and_listed_under_its_experiment(api, cpu_result):
    exp_id = experiment(api)
    r = api.post("/api/v1/gemm-benchmarks", json={"result": cpu_result, "experiment_id": exp_id, "name": "cpu"})
    assert r.status_code == 201, r.text
    bench = r.json()
    assert bench["status"] == "succeeded" and bench["device_name"] == cpu_result["device"]["name"]
    assert bench["result"]["results"] == json.loads(json.dumps(cpu_result["results"]))
    # No FP4 or FP8 hardware on a CPU: nvfp4 emulated, fp8_tensorwise on torch's CPU kernel (backend "cpu").
    assert {r["backend"] for r in bench["result"]["results"] if r["format"] == "fp8_tensorwise"} == {"cpu"}
    assert bench["summary"]["emulated_formats"] == ["fp8_tensorwise", "nvfp4"]
    api.post("/api/v1/gemm-benchmarks", json={"result": cpu_result})  # not attached to the experiment
    page = api.get("/api/v1/gemm-benchmarks", params={"experiment_id": exp_id}).json()
    assert page["total"] == 1 and page["items"][0]["id"] == bench["id"]
    assert "result" not in page["items"][0]  # lists stay small; the detail has the result
    assert api.get(f"/api/v1/gemm-benchmarks/{bench['id']}").json()["result"]["device"]["timer"] == "CPU"
    assert api.get("/api/v1/gemm-benchmarks").json()["total"] == 2


def test_a_result_round_trips_through_postgresql_too(tmp_path, postgres_url, cpu_result):
    api = make_client(tmp_path, url=postgres_url)
    exp_id = experiment(api)
    result = json.loads(json.dumps(cpu_result))
    result["results"][1]["rel_error"] = math.nan  # PostgreSQL's JSON has no NaN: the API stores null
    r = api.post("/api/v1/gemm-benchmarks", content=json.dumps({"result": result, "experiment_id": exp_id}),
                 headers={"Content-Type": "application/json"})
    assert r.status_code == 201, r.text
    stored = api.get(f"/api/v1/gemm-benchmarks/{r.json()['id']}").json()
    result["results"][1]["rel_error"] = None
    assert stored["result"] == result and stored["status"] == "succeeded"
    assert api.get("/api/v1/gemm-benchmarks", params={"experiment_id": exp_id}).json()["total"] == 1


def test_non_finite_numbers_in_a_result_are_stored_as_null(api, cpu_result):
    result = json.loads(json.dumps(cpu_result))
    result["results"][1]["rel_error"] = math.inf  # what a kernel returning Inf gives
    # Python's json writes the non-standard literal Infinity; the API must neither store it nor fail on it.
    r = api.post("/api/v1/gemm-benchmarks", content=json.dumps({"result": result}),
                 headers={"Content-Type": "application/json"})
    assert r.status_code == 201, r.text
    assert api.get(f"/api/v1/gemm-benchmarks/{r.json()['id']}").json()["result"]["results"][1]["rel_error"] is None
    # Our client, which cannot send Infinity at all, sends null in its place.
    assert json_safe({"a": [math.nan, 1.0, -math.inf]}) == {"a": [None, 1.0, None]}


def test_a_worker_moves_a_benchmark_from_queued_to_running_to_succeeded_once(api, cpu_result):
    bid = api.post("/api/v1/gemm-benchmarks", json={"request": cpu_result["request"], "enqueue": False}).json()["id"]
    url = f"/api/v1/gemm-benchmarks/{bid}/status"
    assert api.post(url, json={"status": "running", "device_name": "cpu"}).json()["status"] == "running"
    no_result = api.post(url, json={"status": "succeeded"})
    assert no_result.status_code == 422 and "needs the 'result'" in no_result.json()["detail"]
    done = api.post(url, json={"status": "succeeded", "result": cpu_result})
    assert done.status_code == 200 and done.json()["summary"]["n_shapes"] == 1
    assert api.post(url, json={"status": "succeeded", "result": cpu_result}).status_code == 200  # a retried call
    late = api.post(url, json={"status": "failed", "error_message": "x"})
    assert late.status_code == 409 and "already 'succeeded'" in late.json()["detail"]
    assert api.post(url, json={"status": "queued"}).status_code == 422


def test_a_failed_benchmark_keeps_its_message(api):
    bid = api.post("/api/v1/gemm-benchmarks", json={"request": {"model": "tiny"}, "enqueue": False}).json()["id"]
    r = api.post(f"/api/v1/gemm-benchmarks/{bid}/status", json={"status": "failed", "error_message": "CUDA OOM"})
    assert r.json()["status"] == "failed" and r.json()["error_message"] == "CUDA OOM"


def test_writes_need_the_token_when_the_server_has_one(tmp_path, cpu_result):
    api = make_client(tmp_path, token=TOKEN)
    anonymous = TestClient(api.app)
    r = anonymous.post("/api/v1/gemm-benchmarks", json={"result": cpu_result})
    assert r.status_code == 401 and "Bearer" in r.json()["detail"]
    assert anonymous.get("/api/v1/gemm-benchmarks").status_code == 200  # reads stay open
    assert api.post("/api/v1/gemm-benchmarks", json={"result": cpu_result}).status_code == 201


# ---------------------------------------------------------------- the CLI against a real server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served(home: Path, *, worker: bool = False):
    """`uvicorn backend.app:create_app` (and optionally `plab worker`) on a fresh SQLite database and the embedded
    filesystem broker under `home`: the embedded deployment of `plab demo`, with writes behind a token."""
    port = _free_port()
    env = {**os.environ, "PLAB_HOME": str(home), "PLAB_DATABASE_URL": f"sqlite:///{home / 'db.sqlite'}",
           "PLAB_API_TOKEN": TOKEN, "PLAB_API_URL": f"http://127.0.0.1:{port}", "PYTHONUNBUFFERED": "1",
           "CUDA_VISIBLE_DEVICES": ""}
    env.pop("PLAB_BROKER_URL", None)
    procs = []
    try:
        with open(home / "server.log", "wb") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "uvicorn", "backend.app:create_app", "--factory", "--host", "127.0.0.1",
                 "--port", str(port), "--log-level", "warning"], cwd=REPO, env=env, stdout=log,
                stderr=subprocess.STDOUT))
        if worker:
            with open(home / "worker.log", "wb") as log:
                procs.append(subprocess.Popen([sys.executable, "-m", "plab.cli", "worker", "--slots", "1"],
                                              cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
        http = httpx.Client(base_url=f"http://127.0.0.1:{port}/api/v1",
                            headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
        deadline = time.monotonic() + 60
        while True:
            assert procs[0].poll() is None, (home / "server.log").read_text()
            try:
                if http.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, (home / "server.log").read_text()
            time.sleep(0.2)
        yield http, env
        http.close()
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def plab_gemm_bench(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "plab.cli", "gemm-bench", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_cli_runs_on_cpu_on_a_tiny_shape_list_and_its_result_reaches_the_api(tmp_path):
    with served(tmp_path) as (http, env):
        exp = http.post("/experiments", json={"name": "cli", "training": {"steps": 50}, "enqueue": False}).json()
        out = tmp_path / "bench.json"
        proc = plab_gemm_bench(["--shapes", TINY_SHAPES, "--formats", "bf16,fp8_rowwise,mxfp8", "--device", "cpu",
                                "--repeats", "2", "--warmup", "0", "--no-compile-quant", "--output", str(out),
                                "--experiment", str(exp["id"]), "--name", "tiny on cpu"], env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "timer CPU" in proc.stdout  # the printed timings say they are CPU timings
        assert "stored as GEMM benchmark" in proc.stdout
        # Without the token the server refuses the write: the user is told why and where the JSON is.
        anonymous = {k: v for k, v in env.items() if k != "PLAB_API_TOKEN"}
        refused = plab_gemm_bench(["--shapes", TINY_SHAPES, "--formats", "bf16", "--device", "cpu", "--repeats", "1",
                                   "--output", str(tmp_path / "kept.json"), "--post"], anonymous)
        assert refused.returncode == 2
        assert "did not store its result" in refused.stderr and "Bearer" in refused.stderr
        assert (tmp_path / "kept.json").is_file()
        page = http.get("/gemm-benchmarks", params={"experiment_id": exp["id"]}).json()
        assert page["total"] == 1
        assert http.get("/gemm-benchmarks").json()["total"] == 1
        stored = http.get(f"/gemm-benchmarks/{page['items'][0]['id']}").json()
    assert stored["status"] == "succeeded" and stored["name"] == "tiny on cpu"
    result = stored["result"]
    assert result == json.loads(out.read_text())  # the API holds exactly what the CLI measured
    assert result["device"]["type"] == "cpu" and result["device"]["timer"] == "CPU"
    assert stored["request"]["shapes"] == TINY_SHAPES and stored["request"]["device"] == "cpu"
    assert {(r["format"], r["mode"]) for r in result["results"]} == {
        ("bf16", "both"), ("fp8_rowwise", "kernel"), ("fp8_rowwise", "quant"), ("mxfp8", "kernel"),
        ("mxfp8", "quant")}
    assert all(r["time_s"] > 0 and r["m"] == 64 and r["k"] == 128 and r["n"] == 96 for r in result["results"])
    assert stored["summary"]["emulated_formats"] == ["fp8_rowwise", "mxfp8"]


def test_cli_refuses_before_running_when_the_api_cannot_store_the_result(tmp_path):
    env = {**os.environ, "PLAB_HOME": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    dead = f"http://127.0.0.1:{_free_port()}"
    proc = plab_gemm_bench(["--shapes", TINY_SHAPES, "--device", "cpu", "--post", "--api-url", dead], env)
    assert proc.returncode == 2
    assert "cannot reach the API" in proc.stderr and "plab serve" in proc.stderr
    assert "timing" not in proc.stderr  # nothing was benchmarked


def test_cli_help_documents_the_posting_options():
    proc = plab_gemm_bench(["--help"], dict(os.environ))
    assert proc.returncode == 0
    for flag in ("--shapes", "--post", "--experiment ID", "--api-url", "PLAB_API_TOKEN"):
        assert flag in proc.stdout


# ---------------------------------------------------------------- the Celery task on a real worker
def test_a_queued_benchmark_is_run_by_a_worker_and_its_result_stored(tmp_path):
    with served(tmp_path, worker=True) as (http, env):
        request = {"shapes": TINY_SHAPES, "formats": ["bf16", "fp8_tensorwise"], "modes": ["kernel"],
                   "device": "auto", "repeats": 1, "warmup": 0, "compile_quant": False}
        r = http.post("/gemm-benchmarks", json={"request": request, "name": "via worker"})
        assert r.status_code == 201, r.text
        bid = r.json()["id"]
        deadline = time.monotonic() + 90
        while (bench := http.get(f"/gemm-benchmarks/{bid}").json())["status"] in ("queued", "running"):
            assert time.monotonic() < deadline, (tmp_path / "worker.log").read_text()[-3000:]
            time.sleep(0.5)
        # A request the benchmark refuses at run time (no GPU here) is reported as failed, with its message.
        r = http.post("/gemm-benchmarks", json={"request": {**request, "device": "cuda"}})
        bad = r.json()["id"]
        while (failed := http.get(f"/gemm-benchmarks/{bad}").json())["status"] in ("queued", "running"):
            assert time.monotonic() < deadline + 60, (tmp_path / "worker.log").read_text()[-3000:]
            time.sleep(0.5)
    assert bench["status"] == "succeeded", bench.get("error_message")
    assert bench["result"]["device"]["timer"] == "CPU"  # CUDA_VISIBLE_DEVICES="" in the worker's environment
    assert {(x["format"], x["mode"]) for x in bench["result"]["results"]} == {("bf16", "both"),
                                                                              ("fp8_tensorwise", "kernel")}
    assert bench["result"]["request"] == bench["request"]
    assert failed["status"] == "failed" and "no CUDA GPU is available" in failed["error_message"]
