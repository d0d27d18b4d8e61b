"""The workers' Celery app: `plab.broker`'s app on this environment's broker, with the workers' tasks."""
from __future__ import annotations

from plab.broker import make_app

app = make_app(include=["workers.tasks"])
