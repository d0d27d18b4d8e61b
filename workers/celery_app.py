"""The Celery application shared by the API (to enqueue) and the workers (to consume).

Broker: PLAB_BROKER_URL (e.g. redis://host:6379/0 in served mode). The default, "filesystem://", is kombu's
filesystem transport over a folder under PLAB_HOME: an embedded broker that needs no server, so `plab demo`
runs on a bare machine with the API and the worker in separate processes.
"""
from __future__ import annotations

from celery import Celery

from backend.settings import get_settings


def make_app() -> Celery:
    settings = get_settings()
    app = Celery("plab", include=["workers.tasks", "workers.gemm_tasks"])
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
        conf["broker_transport_options"] = {"visibility_timeout": 6 * 3600}
    app.conf.update(conf)
    return app


app = make_app()
