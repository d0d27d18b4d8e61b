"""The reconciler against the real Redis broker: a run whose worker stopped heartbeating is sent again (then
failed after PLAB_MAX_ATTEMPTS), a queued run whose message Redis lost is sent again, and a job claims its run
so a duplicate message never trains it twice at once."""
from __future__ import annotations

import dataclasses
import threading
import time
from datetime import timedelta

import pytest

from backend.models import Run, utcnow
from backend.services.reconcile import reconcile
from tests.backend.test_api import EXPERIMENT, make_client


@pytest.fixture
def api(tmp_path, broker):
    return make_client(f"sqlite:///{tmp_path / 'plab.sqlite'}", tmp_path, token=None)


def _session(api):
    return api.app.state.sessionmaker()


def _queued_messages(broker) -> int:
    return broker.llen("default")


def _age(api, run_id: int, **fields):
    with _session(api) as s:
        run = s.get(Run, run_id)
        for k, v in fields.items():
            setattr(run, k, v)
        s.commit()


def _pass(api, **over):
    settings = dataclasses.replace(api.app.state.settings, **over)
    with _session(api) as s:
        done = reconcile(s, settings)
        s.commit()
    return done


def test_a_second_job_cannot_claim_a_run_another_job_holds(api, broker):
    exp = api.post("/api/v1/experiments", json={**EXPERIMENT, "recipes": ["bf16"]}).json()
    rid = exp["runs"][0]["id"]
    assert api.post(f"/api/v1/runs/{rid}/status", json={"status": "running"}).status_code == 200
    second = api.post(f"/api/v1/runs/{rid}/status", json={"status": "running"})
    assert second.status_code == 409 and "another job" in second.json()["detail"]
    assert api.post(f"/api/v1/runs/{rid}/heartbeat").json() == {"status": "running", "cancel_requested": False,
                                                                 "worker_host": None}
    _age(api, rid, heartbeat_at=utcnow() - timedelta(minutes=5))
    assert api.post(f"/api/v1/runs/{rid}/status", json={"status": "running"}).status_code == 200


def test_a_run_whose_worker_died_is_sent_again_then_failed_after_max_attempts(api, broker):
    exp = api.post("/api/v1/experiments", json={**EXPERIMENT, "recipes": ["bf16"], "enqueue": True}).json()
    rid = exp["runs"][0]["id"]
    assert _queued_messages(broker) == 1
    broker.delete("default")  # a worker took the message
    assert api.post(f"/api/v1/runs/{rid}/status", json={"status": "running"}).status_code == 200
    assert _pass(api) == {"requeued": [], "failed": [], "resent": []}  # heartbeat fresh
    _age(api, rid, heartbeat_at=utcnow() - timedelta(seconds=120))
    assert _pass(api)["requeued"] == [rid]
    assert api.get(f"/api/v1/runs/{rid}").json()["status"] == "queued"
    assert _queued_messages(broker) == 1
    for _ in range(2):  # started again twice more, and the worker dies each time
        api.post(f"/api/v1/runs/{rid}/status", json={"status": "running"})
        _age(api, rid, heartbeat_at=utcnow() - timedelta(seconds=120))
        _pass(api)
    run = api.get(f"/api/v1/runs/{rid}").json()
    assert run["status"] == "failed" and "stopped heartbeating" in run["error_message"] and run["attempts"] == 3


def test_a_queued_run_whose_message_redis_lost_is_sent_again(api, broker):
    exp = api.post("/api/v1/experiments", json={**EXPERIMENT, "recipes": ["bf16", "fp8_tensorwise"],
                                                "enqueue": True}).json()
    ids = [r["id"] for r in exp["runs"]]
    assert _queued_messages(broker) == 2
    assert _pass(api, requeue_grace_s=0.0)["resent"] == []  # still in the queue
    broker.flushdb()  # Redis restarted without persistence
    assert _pass(api)["resent"] == []  # within the grace period nothing is assumed lost
    assert sorted(_pass(api, requeue_grace_s=0.0)["resent"]) == sorted(ids)
    assert _queued_messages(broker) == 2
    assert _pass(api, requeue_grace_s=0.0)["resent"] == []  # found again: not sent twice


def test_a_worker_writing_to_a_queued_run_does_not_wait_while_the_pass_asks_the_broker(postgres_url, tmp_path, broker):
    """The pass asks the broker about every queued run whose message may be lost; a broker slow to answer (here a
    presence check that waits) must not hold up a worker's metric batch or status report for those runs, which lock
    the run's row. Until 2026-11-29 the pass held every such run locked (FOR UPDATE) while it asked the broker about
    each in turn: under deeper OpenAPI fuzzing on PostgreSQL a metric batch timed out after 10 s behind it."""
    api = make_client(postgres_url, tmp_path, token=None)
    exp = api.post("/api/v1/experiments", json={**EXPERIMENT, "recipes": ["bf16", "fp8_tensorwise"],
                                                "enqueue": True}).json()
    ids = [r["id"] for r in exp["runs"]]
    asked, answer = threading.Event(), threading.Event()
    calls = []

    def slow_broker(task_ids, queues):
        calls.append(sorted(task_ids))
        asked.set()
        answer.wait(60)
        return set()  # every message lost: both runs are sent again

    done = []

    def one_pass():
        settings = dataclasses.replace(api.app.state.settings, requeue_grace_s=0.0)
        with _session(api) as s:
            done.append(reconcile(s, settings, messages_present=slow_broker))
            s.commit()

    reconciler = threading.Thread(target=one_pass)
    reconciler.start()
    try:
        assert asked.wait(30), "the pass never asked the broker"
        answers = []
        writer = threading.Thread(target=lambda: answers.append((
            api.post(f"/api/v1/runs/{ids[0]}/metrics", json={"points": [{"key": "train/loss", "step": 1, "value": 2.5}]}),
            api.post(f"/api/v1/runs/{ids[1]}/status", json={"status": "running"}))))
        started = time.monotonic()
        writer.start()
        writer.join(10)
        waited = time.monotonic() - started
        blocked = writer.is_alive()
    finally:
        answer.set()
        reconciler.join(60)
    writer.join(60)
    assert not blocked, f"the worker's requests waited {waited:.1f} s for the pass's broker question"
    metrics, status = answers[0]
    assert metrics.status_code == 200 and status.status_code == 200, (metrics.text, status.text)
    assert len(calls) == 1 and len(calls[0]) == 2  # the broker asked once about both messages
    # The run that reported `running` meanwhile is not sent again; the other still queued one is.
    assert done == [{"requeued": [], "failed": [], "resent": [ids[0]]}]
    assert _queued_messages(broker) == 3


def test_an_evaluation_whose_worker_died_is_failed_with_the_reason_and_its_run_can_be_deleted(api, broker):
    """An evaluation's job was killed while lm-eval scored: the evaluation stayed `running` for ever, and deleting
    its run or experiment was refused for ever (a review). Its heartbeats renew the lease; once they stop for
    PLAB_STALE_S the reconciler fails it, saying how to start it again."""
    from backend.models import Evaluation

    exp = api.post("/api/v1/experiments", json={**EXPERIMENT, "recipes": ["bf16"]}).json()
    rid = exp["runs"][0]["id"]
    for status in ("running", "succeeded"):
        assert api.post(f"/api/v1/runs/{rid}/status", json={"status": status}).status_code == 200
    with _session(api) as s:
        live, legacy = Evaluation(run_id=rid, tasks=["plab_piqa"]), Evaluation(run_id=rid, tasks=["plab_arc_easy"])
        s.add_all([live, legacy])
        s.commit()
        eid, old = live.id, legacy.id
    assert api.post(f"/api/v1/evaluations/{eid}/status", json={"status": "running"}).status_code == 200
    beat = api.post(f"/api/v1/evaluations/{eid}/heartbeat")
    assert beat.status_code == 200 and beat.json()["status"] == "running"
    with _session(api) as s:  # one running since before heartbeats existed: judged by its creation time
        ev = s.get(Evaluation, old)
        ev.status, ev.created_at = "running", utcnow() - timedelta(minutes=10)
        s.commit()
    assert _pass(api).get("evaluations_failed") == [old]
    assert api.get(f"/api/v1/evaluations/{eid}").json()["status"] == "running"  # heartbeat fresh
    assert api.delete(f"/api/v1/runs/{rid}").status_code == 409

    with _session(api) as s:
        s.get(Evaluation, eid).heartbeat_at = utcnow() - timedelta(seconds=120)
        s.commit()
    assert _pass(api).get("evaluations_failed") == [eid]
    ev = api.get(f"/api/v1/evaluations/{eid}").json()
    assert ev["status"] == "failed" and ev["finished_at"] is not None
    assert ev["error_message"].startswith("the evaluation's worker stopped heartbeating (last heartbeat ")
    assert ev["error_message"].endswith(f"; start it again with POST /api/v1/runs/{rid}/evaluations "
                                        f"(plab eval {rid} --tasks ...)")
    late = api.post(f"/api/v1/evaluations/{eid}/heartbeat")  # a late beat of the killed job changes nothing
    assert late.status_code == 200 and late.json()["status"] == "failed"
    assert api.delete(f"/api/v1/runs/{rid}").status_code == 204


def test_a_job_that_lost_its_run_to_another_job_renews_nothing_and_is_told(api, broker):
    """A job stalled past its lease (SIGSTOP, a frozen host) whose run the reconciler gave to another job: its
    heartbeats kept the other job's lease fresh and told it nothing, so both trained the run (a review). Naming
    itself, it renews only its own lease, and the answer names the holder."""
    exp = api.post("/api/v1/experiments", json={**EXPERIMENT, "recipes": ["bf16"]}).json()
    rid = exp["runs"][0]["id"]
    old, new = "host-a (task 11 attempt 1)", "host-b (task 22 attempt 1)"
    assert api.post(f"/api/v1/runs/{rid}/status", json={"status": "running", "worker_host": old}).status_code == 200
    _age(api, rid, heartbeat_at=utcnow() - timedelta(seconds=120))
    assert _pass(api)["requeued"] == [rid]
    assert api.post(f"/api/v1/runs/{rid}/status", json={"status": "running", "worker_host": new}).status_code == 200
    _age(api, rid, heartbeat_at=utcnow() - timedelta(seconds=50))
    answer = api.post(f"/api/v1/runs/{rid}/heartbeat", params={"holder": old}).json()
    assert answer == {"status": "running", "cancel_requested": False, "worker_host": new}
    assert _pass(api, stale_s=40.0)["requeued"] == [rid]  # the old job's beat did not keep the lease fresh
    assert api.post(f"/api/v1/runs/{rid}/status", json={"status": "running", "worker_host": new}).status_code == 200
    _age(api, rid, heartbeat_at=utcnow() - timedelta(seconds=50))
    api.post(f"/api/v1/runs/{rid}/heartbeat", params={"holder": new})
    assert _pass(api, stale_s=40.0)["requeued"] == []  # its own beat renews it


def test_a_gemm_benchmark_whose_worker_died_is_failed_with_the_reason(api, broker):
    r = api.post("/api/v1/gemm-benchmarks", json={"request": {"shapes": "64x128x96", "device": "cpu"},
                                                   "enqueue": False})
    assert r.status_code == 201, r.text
    bid = r.json()["id"]
    assert api.post(f"/api/v1/gemm-benchmarks/{bid}/status", json={"status": "running"}).status_code == 200
    beat = api.post(f"/api/v1/gemm-benchmarks/{bid}/heartbeat")
    assert beat.status_code == 200 and beat.json()["status"] == "running"
    assert "gemm_benchmarks_failed" not in _pass(api)
    from backend.models import GemmBenchmark

    with _session(api) as s:
        s.get(GemmBenchmark, bid).heartbeat_at = utcnow() - timedelta(seconds=120)
        s.commit()
    assert _pass(api)["gemm_benchmarks_failed"] == [bid]
    bench = api.get(f"/api/v1/gemm-benchmarks/{bid}").json()
    assert bench["status"] == "failed" and bench["error_message"].startswith(
        "the GEMM benchmark's worker stopped heartbeating (last heartbeat ")
    assert bench["error_message"].endswith("; start it again with POST /api/v1/gemm-benchmarks (plab gemm-bench)")


def test_a_queued_evaluation_or_gemm_benchmark_whose_message_redis_lost_is_sent_again(api, broker):
    """Before 2026-12-07 only runs were: an evaluation or benchmark whose message a Redis restart lost stayed
    `queued` for ever (and its run could not be deleted). Each is sent again to the queue it went to, once."""
    from backend.models import Artifact

    exp = api.post("/api/v1/experiments", json={**EXPERIMENT, "recipes": ["bf16"]}).json()
    rid = exp["runs"][0]["id"]
    with _session(api) as s:
        s.add(Artifact(run_id=rid, kind="checkpoint", path="/checkpoints/final", step=50))
        s.commit()
    for status in ("running", "succeeded"):
        assert api.post(f"/api/v1/runs/{rid}/status", json={"status": status}).status_code == 200
    ev = api.post(f"/api/v1/runs/{rid}/evaluations", json={"tasks": ["plab_piqa"]})
    bench = api.post("/api/v1/gemm-benchmarks", json={"request": {"shapes": "64x128x96", "device": "cpu"},
                                                      "queue": "h100"})
    idle = api.post("/api/v1/gemm-benchmarks", json={"request": {"shapes": "64x128x96", "device": "cpu"},
                                                     "enqueue": False})
    assert ev.status_code == 201 and bench.status_code == 201 and idle.status_code == 201, (ev.text, bench.text)
    eid, bid = ev.json()["id"], bench.json()["id"]
    first = {"ev": api.get(f"/api/v1/evaluations/{eid}").json()["dispatch_id"],
             "bench": api.get(f"/api/v1/gemm-benchmarks/{bid}").json()["dispatch_id"]}
    assert broker.llen("default") == 1 and broker.llen("h100") == 1 and all(first.values())
    assert _pass(api, requeue_grace_s=0.0) == {"requeued": [], "failed": [], "resent": []}  # still queued
    broker.flushdb()  # Redis restarted without persistence
    assert _pass(api) == {"requeued": [], "failed": [], "resent": []}  # within the grace period
    done = _pass(api, requeue_grace_s=0.0)
    assert done["evaluations_resent"] == [eid] and done["gemm_benchmarks_resent"] == [bid]  # not the unsent one
    assert broker.llen("default") == 1 and broker.llen("h100") == 1  # each to its own queue
    again = {"ev": api.get(f"/api/v1/evaluations/{eid}").json(), "bench": api.get(f"/api/v1/gemm-benchmarks/{bid}").json()}
    assert all(again[k]["dispatch_id"] not in (None, first[k]) and again[k]["status"] == "queued" for k in again)
    assert _pass(api, requeue_grace_s=0.0) == {"requeued": [], "failed": [], "resent": []}  # found: not sent twice
    # One a worker took: it reports `running` (its message delivered, then acknowledged at the end) and is left.
    broker.flushdb()
    assert api.post(f"/api/v1/evaluations/{eid}/status", json={"status": "running"}).status_code == 200
    assert _pass(api, requeue_grace_s=0.0) == {"requeued": [], "failed": [], "resent": [],
                                               "gemm_benchmarks_resent": [bid]}


def test_on_the_filesystem_broker_a_lost_evaluation_or_benchmark_is_sent_again_too(api, broker, monkeypatch,
                                                                                    tmp_path):
    """kombu's filesystem transport deletes a message's file when a worker takes it, so a queued evaluation or
    benchmark missing from its queue may be starting. Until 2026-12-08 nothing (unlike a run's claim) would have
    stopped a second copy running beside it, so there only runs were re-sent, and a lost evaluation stayed queued
    for ever on the embedded deployment. Every job now claims its row: each is re-sent on every broker (here the
    real filesystem broker of a home of its own)."""
    from backend.models import Evaluation, GemmBenchmark
    from plab.broker import close_senders

    rid = api.post("/api/v1/experiments", json={**EXPERIMENT, "recipes": ["bf16"]}).json()["runs"][0]["id"]
    stamp = utcnow() - timedelta(minutes=5)
    with _session(api) as s:
        ev = Evaluation(run_id=rid, tasks=["plab_piqa"], dispatch_id="ev-message", dispatched_at=stamp)
        bench = GemmBenchmark(request={"shapes": "64x128x96"}, queue="h100", dispatch_id="bench-message",
                              dispatched_at=stamp)
        s.add_all([ev, bench])
        s.commit()
        eid, bid = ev.id, bench.id
    monkeypatch.setenv("PLAB_BROKER_URL", "filesystem://")
    monkeypatch.setenv("PLAB_HOME", str(tmp_path / "embedded"))
    try:
        done = _pass(api)
        assert done["evaluations_resent"] == [eid] and done["gemm_benchmarks_resent"] == [bid]
        messages = b"".join(p.read_bytes() for p in (tmp_path / "embedded" / "broker" / "queue").glob("*"))
        sent = {api.get(f"/api/v1/evaluations/{eid}").json()["dispatch_id"],
                api.get(f"/api/v1/gemm-benchmarks/{bid}").json()["dispatch_id"]}
        assert not sent & {None, "ev-message", "bench-message"} and all(d.encode() in messages for d in sent)
        assert _pass(api) == {"requeued": [], "failed": [], "resent": []}  # found in the folder: not sent twice
    finally:
        close_senders()


@pytest.mark.parametrize("kind", ["evaluation", "gemm"])
def test_a_second_job_cannot_claim_an_evaluation_or_benchmark_another_job_holds(api, broker, kind):
    """As a run's claim: `running` names the job; a second job is refused while the holder's heartbeat is fresh,
    a later attempt of the holder's own message is not, a heartbeat naming another job renews nothing and names
    the holder, and once the lease is stale anyone may claim it."""
    from backend.models import Evaluation, GemmBenchmark

    if kind == "evaluation":
        rid = api.post("/api/v1/experiments", json={**EXPERIMENT, "recipes": ["bf16"]}).json()["runs"][0]["id"]
        with _session(api) as s:
            row = Evaluation(run_id=rid, tasks=["plab_piqa"])
            s.add(row)
            s.commit()
            job_id = row.id
        model, url, failed_key = Evaluation, f"/api/v1/evaluations/{job_id}", "evaluations_failed"
    else:
        r = api.post("/api/v1/gemm-benchmarks", json={"request": {"shapes": "64x128x96", "device": "cpu"},
                                                       "enqueue": False})
        job_id = r.json()["id"]
        model, url, failed_key = GemmBenchmark, f"/api/v1/gemm-benchmarks/{job_id}", "gemm_benchmarks_failed"

    def claim(holder):
        return api.post(f"{url}/status", json={"status": "running", "worker_host": holder})

    def set_row(**fields):
        with _session(api) as s:
            row = s.get(model, job_id)
            for k, v in fields.items():
                setattr(row, k, v)
            s.commit()

    first, copy = "host-a (task 11 attempt 1)", "host-b (task 11 attempt 1)"
    assert claim(first).status_code == 200
    refused = claim(copy)  # the same message delivered twice
    assert refused.status_code == 409 and "being run by another job" in refused.json()["detail"]
    assert claim("host-c (task 99 attempt 1)").status_code == 409  # another message
    assert api.get(url).json()["worker_host"] == first
    set_row(heartbeat_at=utcnow() - timedelta(seconds=50))
    answer = api.post(f"{url}/heartbeat", params={"holder": copy}).json()
    assert answer["status"] == "running" and answer["worker_host"] == first
    assert _pass(api, stale_s=40.0).get(failed_key) == [job_id]  # the copy's beat kept nothing fresh
    set_row(status="running", heartbeat_at=utcnow(), finished_at=None, error_message=None)
    api.post(f"{url}/heartbeat", params={"holder": first})
    retried = claim("host-a (task 11 attempt 2)")  # the worker's retry after its child was killed
    assert retried.status_code == 200 and retried.json()["worker_host"] == "host-a (task 11 attempt 2)"
    set_row(heartbeat_at=utcnow() - timedelta(seconds=120))
    assert claim(copy).status_code == 200  # a stale lease: its holder is gone
    over = api.post(f"{url}/status", json={"status": "running", "worker_host": "h" * 201})
    assert over.status_code == 422 and "worker_host" in over.text


def test_an_evaluation_or_benchmark_whose_worker_died_is_sent_again_then_failed_after_max_attempts(api, broker):
    """Until 2026-12-08 one was failed at once and the user had to start it again; a run in that case was sent to a
    worker again. Now each is taken back like a run: `queued`, sent again to its queue, its starts counted, and
    `failed` with the count once PLAB_MAX_ATTEMPTS starts have died."""
    from backend.models import Artifact, Evaluation, GemmBenchmark

    rid = api.post("/api/v1/experiments", json={**EXPERIMENT, "recipes": ["bf16"]}).json()["runs"][0]["id"]
    with _session(api) as s:
        s.add(Artifact(run_id=rid, kind="checkpoint", path="/checkpoints/final", step=50))
        s.commit()
    for status in ("running", "succeeded"):
        assert api.post(f"/api/v1/runs/{rid}/status", json={"status": status}).status_code == 200
    eid = api.post(f"/api/v1/runs/{rid}/evaluations", json={"tasks": ["plab_piqa"]}).json()["id"]
    bid = api.post("/api/v1/gemm-benchmarks", json={"request": {"shapes": "64x128x96", "device": "cpu"},
                                                    "queue": "h100"}).json()["id"]
    rows = {"evaluations": (Evaluation, eid, f"/api/v1/evaluations/{eid}", "default"),
            "gemm_benchmarks": (GemmBenchmark, bid, f"/api/v1/gemm-benchmarks/{bid}", "h100")}
    broker.flushdb()

    def die(attempt: int) -> None:
        for key, (model, row_id, url, _queue) in rows.items():
            claim = api.post(f"{url}/status", json={"status": "running",
                                                     "worker_host": f"host (task t attempt {attempt})"})
            assert claim.status_code == 200 and claim.json()["attempts"] == attempt, claim.text
            with _session(api) as s:
                s.get(model, row_id).heartbeat_at = utcnow() - timedelta(seconds=120)
                s.commit()

    for attempt in (1, 2):
        before = {key: api.get(url).json()["dispatch_id"] for key, (_m, _i, url, _q) in rows.items()}
        die(attempt)
        done = _pass(api)
        assert done["evaluations_requeued"] == [eid] and done["gemm_benchmarks_requeued"] == [bid], done
        for key, (_model, _row_id, url, queue) in rows.items():
            row = api.get(url).json()
            assert row["status"] == "queued" and row["dispatch_id"] not in (None, before[key])
            assert broker.llen(queue) == 1  # its job sent again, to its own queue
        broker.flushdb()
    die(3)
    done = _pass(api)  # PLAB_MAX_ATTEMPTS is 3
    assert done["evaluations_failed"] == [eid] and done["gemm_benchmarks_failed"] == [bid], done
    assert broker.llen("default") == 0 and broker.llen("h100") == 0
    ev = api.get(f"/api/v1/evaluations/{eid}").json()
    assert ev["status"] == "failed" and ev["finished_at"] is not None and ev["attempts"] == 3
    assert "stopped heartbeating (last heartbeat " in ev["error_message"]
    assert "and it was started 3 times (PLAB_MAX_ATTEMPTS); start it again with POST" in ev["error_message"]
    bench = api.get(f"/api/v1/gemm-benchmarks/{bid}").json()
    assert bench["status"] == "failed" and "started 3 times" in bench["error_message"]
    assert api.delete(f"/api/v1/runs/{rid}").status_code == 204


def test_a_message_a_dead_worker_took_before_its_job_claimed_the_row_is_sent_again(api, broker):
    """A worker killed after it took a job's message but before the job reported `running` left the message in
    Redis's "unacked" until the visibility timeout (6 h), the row `queued` all along (a known gap until
    2026-12-08). A message taken CLAIM_WAIT_STALES x PLAB_STALE_S ago whose row no job claimed is now sent again;
    one taken recently is not, nor a run a Slurm job stands for (its watcher holds the message while Slurm keeps
    the job pending); one whose cancel was requested meanwhile is cancelled. A real kombu consumer takes the
    messages, as a worker does, and never acknowledges them."""
    import time as clock

    from plab.broker import make_app
    from backend.services.reconcile import CLAIM_WAIT_STALES

    exp = api.post("/api/v1/experiments", json={**EXPERIMENT, "recipes": ["bf16", "fp8_tensorwise", "mxfp8"],
                                                "enqueue": True}).json()
    lost, slurm, dropped = (r["id"] for r in exp["runs"])
    first = {rid: api.get(f"/api/v1/runs/{rid}").json()["dispatch_id"] for rid in (lost, slurm)}
    app = make_app()
    try:
        with app.connection_for_read() as conn:
            channel = conn.default_channel
            taken = [channel.basic_get("default", no_ack=False) for _ in range(3)]
            assert all(m is not None for m in taken) and broker.llen("default") == 0
            assert broker.hlen("unacked") == 3
            with _session(api) as s:
                s.get(Run, slurm).summary = {"slurm": {"job_id": "41", "state": "PENDING", "reason": "Resources"}}
                s.get(Run, dropped).cancel_requested = True
                s.commit()
            settings = dataclasses.replace(api.app.state.settings, requeue_grace_s=0.0)
            with _session(api) as s:  # taken seconds ago: its job is starting
                done = reconcile(s, settings)
            assert done["resent"] == [] and "cancelled" not in done
            wait = CLAIM_WAIT_STALES * settings.stale_s
            for tag in broker.zrange("unacked_index", 0, -1):
                broker.zadd("unacked_index", {tag: clock.time() - wait - 5})
            with _session(api) as s:
                done = reconcile(s, settings)
            assert done["resent"] == [lost] and done["cancelled"] == [dropped]
            assert api.get(f"/api/v1/runs/{dropped}").json()["status"] == "cancelled"
            again = api.get(f"/api/v1/runs/{lost}").json()
            assert again["status"] == "queued" and again["dispatch_id"] not in (None, first[lost])
            assert api.get(f"/api/v1/runs/{slurm}").json()["dispatch_id"] == first[slurm]
            assert broker.llen("default") == 1  # the new message waits for a worker
            with _session(api) as s:  # found waiting: not sent twice
                assert reconcile(s, settings)["resent"] == []
    finally:
        app.close()
