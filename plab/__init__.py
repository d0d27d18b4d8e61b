"""What the API, the workers and the command line share: the settings read from the environment (`plab.settings`),
the Celery app and the task names both sides agree on (`plab.broker`), and the `plab` command (`plab.cli`).

`backend/` and `workers/` import `plab.settings` and `plab.broker`, never each other; `plab.cli` sits on top and
starts either of them.
"""
