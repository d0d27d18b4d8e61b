"""MetricStreamer against a real API: batches, idempotent re-sends and retries, flush/close, cancellation."""
from __future__ import annotations

import math
import threading
import time

from tests.workers.conftest import TOKEN, new_run
from workers.client import PlabClient


class RecordingClient(PlabClient):
    """The real client, remembering the size and the server's answer of every metric batch it sent."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.batches: list[tuple[int, dict]] = []

    def log_metrics(self, run_id: int, points: list[dict], **kw) -> dict:
        answer = super().log_metrics(run_id, points, **kw)
        self.batches.append((len(points), answer))
        return answer


def stored(client: PlabClient, run_id: int, key: str = "train/loss") -> dict:
    return client.series(run_id, key, max_points=100_000)


def wait_for(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_points_go_in_batches_of_at_most_max_batch_and_all_arrive(live_api):
    client = RecordingClient(live_api.url, TOKEN)
    run = new_run(client)
    streamer = client.stream(run["id"], max_batch=300, flush_interval=30)  # only flush() sends
    for step in range(500):
        streamer.log(step, {"train/loss": 1.0 / (step + 1), "train/lr": 1e-3}, tokens=step * 256)
    streamer.flush()
    sizes = [n for n, _ in client.batches]
    assert sum(sizes) == 1000 and max(sizes) <= 300 and len(sizes) >= 4
    assert streamer.sent == 1000 and streamer.errors == []
    series = stored(client, run["id"])
    assert series["step"] == list(range(500)) and series["tokens"][-1] == 499 * 256
    assert stored(client, run["id"], "train/lr")["step"] == list(range(500))
    streamer.close()


def test_re_sent_steps_are_counted_as_duplicates_and_stored_once(live_api):
    client = RecordingClient(live_api.url, TOKEN)
    run = new_run(client)
    with client.stream(run["id"]) as streamer:
        for step in range(10):
            streamer.log(step, {"train/loss": float(step)})
        streamer.flush()
        # A job resumed from a checkpoint at step 5 logs steps 5..9 again.
        for step in range(5, 15):
            streamer.log(step, {"train/loss": float(step)})
    answers = [a for _, a in client.batches]
    assert sum(a["inserted"] for a in answers) == 15 and sum(a["duplicates"] for a in answers) == 5
    assert stored(client, run["id"])["step"] == list(range(15))


def test_points_logged_while_the_api_is_down_arrive_once_when_it_is_back(api_env):
    # retries=0: every connection error reaches the streamer, whose own loop must retry.
    client = PlabClient(api_env.url, TOKEN, retries=0)
    streamer = client.stream(1, flush_interval=0.1)
    for step in range(20):
        streamer.log(step, {"train/loss": 2.0})
    wait_for(lambda: streamer.errors)  # the first attempt failed: nothing listens yet
    api_env.start()
    run = new_run(api_env.client())
    assert run["id"] == 1
    streamer.flush()
    assert streamer.sent == 20
    assert stored(client, 1)["step"] == list(range(20))
    streamer.close()


def test_a_batch_the_api_refuses_is_dropped_with_its_error_instead_of_retried_forever(live_api):
    client = live_api.client()
    streamer = client.stream(999_999, flush_interval=0.05)  # no such run: 404
    streamer.log(0, {"train/loss": 1.0})
    started = time.monotonic()
    streamer.flush()
    assert time.monotonic() - started < 10
    assert streamer.sent == 0 and len(streamer.errors) == 1 and "404" in streamer.errors[0]
    streamer.close()


def test_non_finite_values_are_stored_as_null(client):
    run = new_run(client)
    with client.stream(run["id"]) as streamer:
        streamer.log(0, {"train/loss": math.nan})
        streamer.log(1, {"train/loss": math.inf})
        streamer.log(2, {"train/loss": 0.5})
    assert stored(client, run["id"])["value"] == [None, None, 0.5]


def test_flush_returns_when_everything_logged_is_stored_and_close_sends_the_rest(client):
    run = new_run(client)
    streamer = client.stream(run["id"], flush_interval=30)
    for step in range(50):
        streamer.log(step, {"train/loss": 1.0})
    streamer.flush()
    assert len(stored(client, run["id"])["step"]) == 50  # no waiting: flush has returned
    for step in range(50, 80):
        streamer.log(step, {"train/loss": 1.0})
    streamer.close()  # without a flush first
    assert stored(client, run["id"])["step"] == list(range(80))
    assert not [t for t in threading.enumerate() if t.name == f"plab-metrics-{run['id']}"]


def test_a_cancel_seen_in_a_batch_answer_calls_on_cancel_once(client):
    run = new_run(client)
    client.set_status(run["id"], "running")
    calls = []
    with client.stream(run["id"], flush_interval=0.05, on_cancel=lambda: calls.append(time.monotonic())) as streamer:
        streamer.log(0, {"train/loss": 1.0})
        streamer.flush()
        assert calls == [] and not streamer.cancel_requested
        client.cancel_run(run["id"])
        for step in range(1, 4):
            streamer.log(step, {"train/loss": 1.0})
            streamer.flush()
        assert streamer.cancel_requested and len(calls) == 1


def test_a_quiet_run_still_learns_of_a_cancel_by_polling(client):
    run = new_run(client)
    client.set_status(run["id"], "running")
    seen = threading.Event()
    with client.stream(run["id"], flush_interval=0.05, poll_interval=0.2, on_cancel=seen.set) as streamer:
        client.cancel_run(run["id"])
        assert seen.wait(10), streamer.errors  # nothing was logged: only the poll can have seen it
        assert streamer.sent == 0
