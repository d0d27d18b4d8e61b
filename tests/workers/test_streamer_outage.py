"""The metric streamer never blocks training on an API that is down: 5xx/connection failures spill batches to a
file after a short retry, `flush()` returns within seconds, and the spill is replayed in order once the API
answers; a 4xx batch is dropped with a message. Against a real HTTP server whose answers the test switches."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from workers.client import MetricStreamer, PlabClient


class Api:
    def __init__(self):
        self.status = 200
        self.stored: list[tuple[str, int]] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if api.status == 200:  # the compact form the client sends: {"series": [{key, points}]}
                    got = [(s["key"], p[0]) for s in body["series"] for p in s["points"]]
                    api.stored += got
                    answer = {"inserted": len(got), "duplicates": 0, "run_status": "running",
                              "cancel_requested": False}
                else:
                    answer = {"detail": "down"}
                data = json.dumps(answer).encode()
                self.send_response(api.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture
def api():
    a = Api()
    yield a
    a.server.shutdown()


def test_an_api_outage_spills_and_replays_without_blocking_flush(api, tmp_path):
    spill = tmp_path / "run" / "metrics-spill.jsonl"
    client = PlabClient(api.url, retries=0)
    streamer = MetricStreamer(client, 7, flush_interval=0.05, spill_path=str(spill), send_retries=1)
    api.status = 503
    for step in range(5):
        streamer.log(step, {"train/loss": 1.0})
    start = time.monotonic()
    streamer.flush()
    assert time.monotonic() - start < 5  # bounded: a short retry, then the spill file
    assert spill.exists() and streamer.spilled == 5
    api.status = 200
    for step in range(5, 8):
        streamer.log(step, {"train/loss": 1.0})
    streamer.close()
    assert sorted(api.stored) == [("train/loss", s) for s in range(8)]
    assert not spill.exists()


def test_a_refused_batch_is_dropped_with_a_message_not_retried(api, tmp_path, capsys):
    api.status = 422
    streamer = MetricStreamer(PlabClient(api.url, retries=0), 7, flush_interval=0.05,
                              spill_path=str(tmp_path / "s.jsonl"))
    streamer.log(0, {"train/loss": 1.0})
    start = time.monotonic()
    streamer.close()
    assert time.monotonic() - start < 3
    assert streamer.dropped == 1 and "rejected, dropped" in capsys.readouterr().err
    assert not (tmp_path / "s.jsonl").exists()
