"""The Celery app on PLAB_BROKER_URL and the task names that the API (sending) and the workers (consuming) share.

Broker: PLAB_BROKER_URL (e.g. redis://host:6379/0 in served mode). The default, "filesystem://", is kombu's
filesystem transport over a folder under PLAB_HOME: an embedded broker that needs no server, so `plab demo`
runs on a bare machine with the API and the worker in separate processes. Both sides must build the app from the
same settings (the filesystem transport's folders are part of them), hence one builder here.
"""
from __future__ import annotations

from collections.abc import Collection

from celery import Celery

from plab.settings import get_settings

# Task names are the contract between the two sides: messages already queued carry them.
TRAIN_TASK = "workers.tasks.train_run"
EVALUATE_TASK = "workers.tasks.evaluate_run"
GEMM_TASK = "workers.tasks.gemm_bench"

# Sending apps by (broker URL, broker folder): one per process in practice, a new one when the environment names
# another broker (tests, a CLI that changed PLAB_HOME), so a message never lands in a stale broker.
_senders: dict[tuple[str, str], Celery] = {}


def make_app(include: list[str] | None = None) -> Celery:
    """A Celery app on this environment's broker; `include` names the modules that define tasks (workers only)."""
    settings = get_settings()
    app = Celery("plab", include=include or [])
    conf = dict(
        broker_url=settings.broker_url,
        task_default_queue="default",
        task_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,
        # acks_late + prefetch 1: a job whose worker dies is redelivered and resumes from its last checkpoint.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )
    if settings.broker_url.startswith("filesystem://"):
        folder = settings.broker_folder
        for sub in ("queue", "processed", "control"):
            (folder / sub).mkdir(parents=True, exist_ok=True)
        conf["broker_transport_options"] = {
            "data_folder_in": str(folder / "queue"), "data_folder_out": str(folder / "queue"),
            "processed_folder": str(folder / "processed"), "store_processed": False,
            "control_folder": str(folder / "control")}
        # The filesystem transport has no broadcast exchange: no remote control, mingle or gossip.
        conf["worker_enable_remote_control"] = False
    elif settings.broker_url.startswith("redis"):
        # Longer than the longest gap between checkpoints of a training job, so a slow job is not redelivered
        # to a second worker while the first is still alive.
        # The reconciler (backend/services/reconcile.py) re-sends the run of a dead worker within a minute from its
        # heartbeats; a redelivery after this timeout finds the run claimed or finished and does nothing.
        conf["broker_transport_options"] = {"visibility_timeout": 6 * 3600}
    app.conf.update(conf)
    return app


def send_task(name: str, args: list, *, kwargs: dict | None = None, queue: str = "default") -> str:
    """Send a job message by task name to this environment's broker; returns the message's (task) id."""
    settings = get_settings()
    key = (settings.broker_url, str(settings.broker_folder))
    if key not in _senders:
        _senders[key] = make_app()
    return _senders[key].send_task(name, args=args, kwargs=kwargs or {}, queue=queue).id


def close_senders() -> None:
    """Close every broker connection `send_task` keeps open in this process (kombu's pools are per process, shared
    by every app on a broker): a process done with a broker (a test's own Redis database) must not stay connected
    to it. The next `send_task` connects anew."""
    from kombu import pools

    while _senders:
        _senders.popitem()[1].close()
    pools.reset()


def messages_present(task_ids: Collection[str], queues: list[str]) -> set[str] | None:
    """Which of the messages `task_ids` the broker still holds – waiting in one of `queues` or delivered and not yet
    acknowledged – read in one pass over the broker's messages (the reconciler asks about every queued run at once:
    one read per run made a pass over N queued runs read the queues N times); None when this broker cannot be
    asked (then nothing is re-sent on its account)."""
    settings = get_settings()
    if settings.broker_url.startswith("redis"):
        import redis

        client = redis.Redis.from_url(settings.broker_url)
        try:
            # The queues before the delivered ones: a message a worker takes meanwhile moves from a queue to
            # "unacked", so it is seen in one or the other (read the other way round, it could be in neither).
            raws = [raw for q in queues for raw in client.lrange(q, 0, -1)] + list(client.hvals("unacked"))
        finally:
            client.close()
    elif settings.broker_url.startswith("filesystem://"):
        raws = []
        for path in (settings.broker_folder / "queue").glob("*"):
            try:
                raws.append(path.read_bytes())
            except (FileNotFoundError, IsADirectoryError):  # consumed by a worker since the listing
                continue
    else:
        return None
    held = b"\x00".join(raws)  # a task id is a UUID: it cannot span two messages across the separator
    return {t for t in task_ids if t.encode() in held}


def taken_before(task_ids: Collection[str], before: float) -> set[str] | None:
    """Which of the messages `task_ids` a worker took before the Unix time `before` and has not acknowledged: on
    Redis, kombu keeps such a message in "unacked" with its delivery time in "unacked_index" until the worker
    acknowledges it, or, if the worker died, until the transport's visibility timeout (6 h) puts it back in its
    queue. None where the broker cannot say (the filesystem broker deletes a message's file when a worker takes it)."""
    settings = get_settings()
    if not settings.broker_url.startswith("redis"):
        return None
    import redis

    client = redis.Redis.from_url(settings.broker_url)
    try:
        tags = client.zrangebyscore("unacked_index", "-inf", before)
        raws = [raw for raw in (client.hmget("unacked", tags) if tags else []) if raw is not None]
    finally:
        client.close()
    held = b"\x00".join(raws)
    return {t for t in task_ids if t.encode() in held}


def train_gpus(spec: dict) -> int:
    """GPUs a training job runs on (`training.gpus` of its run spec; more than one means torchrun)."""
    return int((spec.get("training") or {}).get("gpus") or 1)
