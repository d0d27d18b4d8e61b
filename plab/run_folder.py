"""Whose run a folder PLAB_HOME/runs/<id> is.

Run ids are the database's, and PLAB_HOME outlives a database: a switch from the embedded SQLite to PostgreSQL, a
recreated database volume, a restored backup. runs/<id> may then hold another database's run <id>, whose
checkpoints a job resuming this run took as its own (a run that "succeeded" in a fraction of a second with the
other run's loss, or one resumed at the other's step) and which deleting this run removed.

A folder names its run in `run.json`: the run's id, its experiment's id and the row's creation time, which two
databases do not share. Before a job trains a run (`claim`), a folder naming another run, or holding files but
no name while the run has never been started, is moved aside to runs/<id>.other-<UTC time> (nothing is deleted;
the worker's log says where it went); a deletion (`remove`) removes only the run's own folder. A folder without
`run.json` of a run that has been started before is taken as the run's own: it was written before this file
existed.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from datetime import datetime, timezone
from pathlib import Path

log = logging.getLogger("plab.run_folder")

IDENTITY_FILE = "run.json"


def folder_of(home: Path, run_id: int) -> Path:
    """Where a run's files live (workers write checkpoints and logs there): PLAB_HOME/runs/<id>."""
    return Path(home) / "runs" / str(int(run_id))


def _utc(value) -> datetime | None:
    try:
        stamp = value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
    except (TypeError, ValueError):
        return None
    return stamp.replace(tzinfo=timezone.utc) if stamp.tzinfo is None else stamp.astimezone(timezone.utc)


def identity(run_id: int, experiment_id: int, created_at) -> dict:
    """What `run.json` holds: the ids and the row's creation time (a datetime or the API's ISO text)."""
    stamp = _utc(created_at)
    return {"run_id": int(run_id), "experiment_id": int(experiment_id),
            "created_at": stamp.isoformat() if stamp else str(created_at)}


def named(folder: Path) -> dict | None:
    """The run a folder names, None where it names none (no run.json, or one that cannot be read)."""
    try:
        data = json.loads((Path(folder) / IDENTITY_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _same(a: dict, b: dict) -> bool:
    return (a.get("run_id") == b.get("run_id") and a.get("experiment_id") == b.get("experiment_id")
            and _utc(a.get("created_at")) is not None and _utc(a.get("created_at")) == _utc(b.get("created_at")))


def owned_by(folder: Path, run: dict, started_before: bool) -> bool:
    """Whether `folder` is the run's (`run`: `identity`): it names the run, or it names none and is empty or
    absent, or it names none and the run was started before (a folder from before run.json)."""
    folder = Path(folder)
    name = named(folder)
    if name is not None:
        return _same(name, run)
    if not folder.exists():
        return True
    return started_before or not any(folder.iterdir())


def claim(home: Path, run: dict, started_before: bool) -> Path | None:
    """Make runs/<id> the run's before a job trains it: a folder of another run is moved aside first. Returns
    where it went (None when nothing moved). Two jobs doing this at once for one run move at most one folder."""
    folder = folder_of(home, run["run_id"])
    moved = None
    if not owned_by(folder, run, started_before):
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
        aside = folder.with_name(f"{folder.name}.other-{stamp}")
        try:
            folder.rename(aside)
            moved = aside
            other = named(aside)
            log.warning("run %s: %s held %s, not this run (%s); moved it to %s", run["run_id"], folder,
                        f"run {other.get('run_id')} of experiment {other.get('experiment_id')} created "
                        f"{other.get('created_at')}" if other else "files of a run never started in this database",
                        f"experiment {run['experiment_id']}, created {run['created_at']}", aside)
        except FileNotFoundError:  # another job moved it first
            pass
    folder.mkdir(parents=True, exist_ok=True)
    if named(folder) is None:
        tmp = folder / f".{IDENTITY_FILE}.{os.getpid()}"
        tmp.write_text(json.dumps(run) + "\n")
        os.replace(tmp, folder / IDENTITY_FILE)
    return moved


def remove(home: Path, run: dict, started_before: bool) -> bool:
    """Delete runs/<id> if it is the run's (`owned_by`); a folder of another run is left, with a warning.
    Returns whether it was removed."""
    folder = folder_of(home, run["run_id"])
    if not folder.exists():
        return False
    if not owned_by(folder, run, started_before):
        log.warning("run %s deleted; its folder %s holds another run's files (%s) and is left", run["run_id"],
                    folder, named(folder) or "no run.json")
        return False
    shutil.rmtree(folder, ignore_errors=True)
    return True
