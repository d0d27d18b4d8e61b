"""`plab.run_folder`: PLAB_HOME/runs/<id> names its run, so a folder another database's run <id> left there is
neither resumed from nor deleted. With a real API and `workers.tasks.run_job`, as a worker starts a training job."""
from __future__ import annotations

import json
import sys

from plab import run_folder
from tests.workers.conftest import new_run
from tests.workers.test_job_tasks import job_task
from workers.jobs import EXIT_SKIPPED, train

OTHER = run_folder.identity(1, 7, "2026-11-01T09:00:00.123456+00:00")


def _other_runs_folder(home, run_id: int, name: dict | None = OTHER):
    folder = run_folder.folder_of(home, run_id)
    (folder / "checkpoints" / "step_00000200").mkdir(parents=True)
    (folder / "checkpoints" / "step_00000200" / "model.safetensors").write_bytes(b"w" * 10)
    if name is not None:
        (folder / run_folder.IDENTITY_FILE).write_text(json.dumps({**name, "run_id": run_id}))
    return folder


def test_a_job_moves_another_databases_run_folder_aside_and_trains_in_its_own(client, tmp_path, api_env):
    run = new_run(client)
    home = api_env.home
    _other_runs_folder(home, run["id"])
    seen = tmp_path / "seen.json"
    # the child records what it finds in the run's folder, as the training job would before resuming
    look = (f"import json, os, pathlib; f = pathlib.Path({str(home)!r}) / 'runs' / '{run['id']}'; "
            f"pathlib.Path({str(seen)!r}).write_text(json.dumps(sorted(os.listdir(f))))")
    task = job_task(train, lambda _id: [sys.executable, "-c", look])
    assert task.apply(args=[run["id"]]).get() == 0
    assert json.loads(seen.read_text()) == [run_folder.IDENTITY_FILE]  # no checkpoints of the other run
    named = run_folder.named(run_folder.folder_of(home, run["id"]))
    assert named == run_folder.identity(run["id"], run["experiment_id"], run["created_at"])
    aside = [p for p in (home / "runs").iterdir() if p.name.startswith(f"{run['id']}.other-")]
    assert len(aside) == 1 and (aside[0] / "checkpoints" / "step_00000200" / "model.safetensors").exists()
    assert run_folder.named(aside[0])["created_at"] == OTHER["created_at"]

    # a second job for the same run (a retry, a re-sent message) keeps the folder: it is the run's now
    (run_folder.folder_of(home, run["id"]) / "checkpoints").mkdir()
    assert task.apply(args=[run["id"]]).get() == 0
    assert json.loads(seen.read_text()) == ["checkpoints", run_folder.IDENTITY_FILE]
    assert len([p for p in (home / "runs").iterdir() if p.name.startswith(f"{run['id']}.")]) == 1


def test_an_unnamed_folder_is_the_runs_own_only_if_the_run_was_started_before(tmp_path):
    """A folder from before run.json existed: a run that was started before (attempts > 0) resumes from it, as it
    did; a run never started cannot have written it, so it is moved aside."""
    mine = run_folder.identity(3, 2, "2026-12-07T10:00:00+00:00")
    folder = _other_runs_folder(tmp_path, 3, name=None)
    assert run_folder.claim(tmp_path, mine, started_before=True) is None
    assert (folder / "checkpoints").exists() and run_folder.named(folder) == mine

    fresh = run_folder.identity(4, 2, "2026-12-07T10:00:01+00:00")
    folder = _other_runs_folder(tmp_path, 4, name=None)
    moved = run_folder.claim(tmp_path, fresh, started_before=False)
    assert moved is not None and (moved / "checkpoints").exists() and not (folder / "checkpoints").exists()
    assert run_folder.named(folder) == fresh

    # an empty folder or none at all is simply taken
    (tmp_path / "runs" / "5").mkdir()
    assert run_folder.claim(tmp_path, run_folder.identity(5, 2, "2026-12-07T10:00:02Z"), False) is None
    assert run_folder.claim(tmp_path, run_folder.identity(6, 2, "2026-12-07T10:00:03Z"), False) is None
    assert run_folder.named(tmp_path / "runs" / "6")["run_id"] == 6


def test_the_creation_time_is_compared_as_a_time_not_as_text(tmp_path):
    """The API writes ISO text with an offset; SQLite hands the backend a naive datetime: the same instant."""
    from datetime import datetime

    run_folder.claim(tmp_path, run_folder.identity(8, 1, "2026-12-07T10:00:00.5+00:00"), started_before=False)
    same = run_folder.identity(8, 1, datetime(2026, 12, 7, 10, 0, 0, 500000))
    assert run_folder.owned_by(run_folder.folder_of(tmp_path, 8), same, started_before=False)
    later = run_folder.identity(8, 1, datetime(2026, 12, 7, 10, 0, 0, 500001))
    assert not run_folder.owned_by(run_folder.folder_of(tmp_path, 8), later, started_before=True)


def test_a_deletion_removes_the_runs_own_folder_and_leaves_another_runs(tmp_path):
    mine = run_folder.identity(1, 1, "2026-12-07T10:00:00+00:00")
    run_folder.claim(tmp_path, mine, started_before=False)
    assert run_folder.remove(tmp_path, mine, started_before=True) and not (tmp_path / "runs" / "1").exists()
    folder = _other_runs_folder(tmp_path, 1)
    assert not run_folder.remove(tmp_path, mine, started_before=True) and (folder / "checkpoints").exists()


def test_a_run_folder_the_worker_cannot_write_fails_the_run_before_it_trains(client, api_env):
    """A file where runs/<id> should be (or a folder without write permission): the run fails at once, saying
    which folder, instead of training until its first checkpoint (or the job erring and the run staying queued)."""
    run = new_run(client)
    (api_env.home / "runs").mkdir(exist_ok=True)
    (api_env.home / "runs" / str(run["id"])).write_text("not a folder")
    task = job_task(train, lambda _id: [sys.executable, "-c", "raise SystemExit('the child must not start')"])
    assert task.apply(args=[run["id"]]).get() == EXIT_SKIPPED  # the child never started
    stored = client.get_run(run["id"])
    assert stored["status"] == "failed"
    assert stored["error_message"].startswith(f"the run's folder {api_env.home / 'runs' / str(run['id'])} cannot be "
                                              f"written on this worker")
