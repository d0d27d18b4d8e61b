"""The training job's sink against a real API: tokenization progress lands in the run's summary."""
from __future__ import annotations

from tests.workers.conftest import new_run
from workers.client import MetricStreamer
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
