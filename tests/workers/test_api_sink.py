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
    err = capsys.readouterr().err
    assert err.count("[plab] could not report") == 3 and "run_info" in err and "conversion_report" in err
