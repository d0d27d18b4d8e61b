"""The training job's sink against a real API: tokenization progress and what the run is land in its summary."""
from __future__ import annotations

from tests.workers.conftest import new_run
from workers.client import MetricStreamer, PlabClient
from workers.jobs.train import ApiSink


def test_data_progress_events_reach_the_run_summary_and_the_last_one_wins(client):
    run = new_run(client)
    client.set_status(run["id"], "running", worker_host="test-host")
    streamer = MetricStreamer(client, run["id"])
    try:
        sink = ApiSink(client, run["id"], streamer)
        for documents, done in ((10, False), (40, True)):
            sink.event("data_progress", phase="tokenizing", documents=documents, tokens=100 * documents,
                       tokens_per_s=5000, fraction=documents / 40, eta_s=0.0, done=done)
    finally:
        streamer.close()
    summary = client.get_run(run["id"])["summary"]
    assert summary["data_progress"] == {"phase": "tokenizing", "documents": 40, "tokens": 4000, "tokens_per_s": 5000,
                                        "fraction": 1.0, "eta_s": 0.0, "done": True}


def test_what_the_run_is_reaches_its_summary_when_it_starts(client):
    run = new_run(client)
    client.set_status(run["id"], "running", worker_host="test-host")
    streamer = MetricStreamer(client, run["id"])
    model = {"architecture": "LlamaForCausalLM", "params": 1234, "blocks": 2}
    validation = {"windows": 8, "tokens": 256, "rule": "spread", "split_windows": 90, "split_tokens": 2881}
    try:
        sink = ApiSink(client, run["id"], streamer)
        sink.event("data_progress", phase="tokenizing", documents=1, tokens=10, tokens_per_s=5, fraction=1.0,
                   eta_s=0.0, done=True)
        sink.event("run_info", params=1234, model=model, data={"files": 1}, validation=validation, world_size=1,
                   inductor_settings={"x": 1}, device_name="cpu", total_steps=10, start_step=0)
    finally:
        streamer.close()
    summary = client.get_run(run["id"])["summary"]
    assert summary["model"] == model and summary["validation"] == validation and summary["params"] == 1234
    assert summary["data"] == {"files": 1} and summary["world_size"] == 1
    assert "inductor_settings" not in summary and "total_steps" not in summary  # the result's, not the start's
    assert summary["data_progress"]["done"] is True  # merged, not replaced


def test_an_api_that_is_away_never_stops_training_and_progress_waits_only_briefly(capsys):
    """Reporting must never kill a training job: an unreachable API raised httpx's own errors (not OSError) out of the
    sink into the training loop once the client's retries ran out. Progress and the run's description give up after
    a few retries (about 1.5 s), not the job client's ten minutes; the conversion report keeps the client's."""
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    client = PlabClient(f"http://127.0.0.1:{port}", retries=1)
    sink = ApiSink(client, 1, streamer=object())  # any streamer: events are sent only when there is one
    started = time.perf_counter()
    sink.event("data_progress", phase="tokenizing", documents=1, done=False)
    sink.event("run_info", params=10, model={"architecture": "x"})
    sink.event("conversion_report", report={"layers": [], "gemm_backend": "real"})
    assert time.perf_counter() - started < 10
    assert sink.close(timeout=30)
    err = capsys.readouterr().err
    assert err.count("[plab] could not report") == 3 and "run_info" in err and "conversion_report" in err


def test_reports_sent_once_wait_for_the_api_on_their_own_thread_not_the_training_one(capsys, tmp_path):
    """The conversion report and a checkpoint's artifact keep the client's patient retries, but on the reporter's
    thread: rank 0 hands them over and trains on (waiting there held every other rank at its next collective);
    the job waits for them only when it ends, before it reports its result."""
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = PlabClient(f"http://127.0.0.1:{port}", retries=3)  # 0.5 + 1 + 2 s of back-off per report
    sink = ApiSink(client, 1, streamer=object())
    started = time.perf_counter()
    sink.event("conversion_report", report={"layers": [], "gemm_backend": "real"})
    sink.event("checkpoint", path=str(tmp_path / "step_00000002"), step=2, format="native")
    assert time.perf_counter() - started < 0.5
    assert not sink.close(timeout=0.2)  # still retrying: a failed job stops waiting after FAILED_DRAIN_S
    assert "reports still waiting for the API" in capsys.readouterr().err
    assert sink.close(timeout=30)
    err = capsys.readouterr().err
    assert "could not report conversion_report" in err and "could not report checkpoint" in err


def test_the_conversion_report_and_checkpoints_reach_the_run_in_order_once_closed(client, tmp_path):
    run = new_run(client)
    client.set_status(run["id"], "running", worker_host="test-host")
    streamer = MetricStreamer(client, run["id"])
    report = {"layers": [{"name": "layers.0.mlp", "converted": True}], "gemm_backend": "emulated"}
    try:
        sink = ApiSink(client, run["id"], streamer)
        sink.event("conversion_report", report=report)
        for step in (2, 4):
            sink.event("checkpoint", path=str(tmp_path / f"step_{step:08d}"), step=step, format="native")
        assert sink.close()
    finally:
        streamer.close()
    record = client.get_run(run["id"])
    assert record["conversion_report"] == report and record["gemm_backend"] == "emulated"
    artifacts = [a for a in client._request("GET", f"/runs/{run['id']}/artifacts") if a["kind"] == "checkpoint"]
    assert [a["step"] for a in artifacts] == [2, 4] and all(a["meta"] == {"format": "native"} for a in artifacts)


def test_a_report_the_api_client_cannot_encode_does_not_stop_the_later_ones(capsys, tmp_path):
    """A value JSON cannot carry (a NaN in a checkpoint's meta: httpx refuses it with ValueError) is reported as not
    sent; the reporter's thread goes on with the next report, and one submitted after close says it is not sent."""
    sent = []

    class Client:
        def add_artifact(self, run_id, kind, path, step=None, meta=None):
            if meta.get("loss") != meta.get("loss"):
                raise ValueError("Out of range float values are not JSON compliant")
            sent.append(step)

    sink = ApiSink(Client(), 1, streamer=object())
    sink.event("checkpoint", path=str(tmp_path / "a"), step=2, loss=float("nan"))
    sink.event("checkpoint", path=str(tmp_path / "b"), step=4, loss=1.5)
    assert sink.close(timeout=30) and sent == [4]
    sink.event("checkpoint", path=str(tmp_path / "c"), step=6, loss=1.4)
    err = capsys.readouterr().err
    assert "could not report checkpoint: ValueError" in err and "checkpoint not reported: the job's reports" in err
    assert sent == [4]

