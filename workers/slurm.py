"""Training jobs on a Slurm cluster: `plab worker --launcher slurm` takes runs from its Celery queue as always and
submits each as one Slurm batch job, then watches it until the run has an outcome.

Why `sbatch` and not submitit: the job is a command line (`srun` starting `torchrun` on every node, which runs
`workers.jobs.train RUN_ID`), not a pickled Python function; Slurm itself holds the state that matters (the
job's state and reason, requeue, cancel), read with `scontrol`/`squeue` and changed with `scancel`/`scontrol
requeue`; and nothing needs a shared folder of pickles. submitit's value (calling Python functions remotely,
its own checkpoint protocol) is not used here: a run resumes from its own checkpoints.

The Slurm job: `training.nodes` nodes, one `torchrun` per node with `training.gpus` processes (GPUs per node;
gloo processes on CPU nodes), c10d rendezvous on the first node's address, `--requeue`. The environment of the
worker (API URL and token, data directory, PLAB_HOME) is passed through (`sbatch --export=ALL`, the default).

States (`scontrol show job`): PENDING (and CONFIGURING, REQUEUED...) leaves the run `queued` with the Slurm job
id, state and reason in its summary (`summary.slurm`); RUNNING is the run's own `running` (the job claims it as
"slurm job N"; the same Slurm job restarted may claim it again); COMPLETED, FAILED, OUT_OF_MEMORY, BOOT_FAIL,
DEADLINE end it (`failed` with the state when the job did not report); CANCELLED is `cancelled`; PREEMPTED,
NODE_FAIL and TIMEOUT are requeued (`scontrol requeue`, at most PLAB_MAX_ATTEMPTS times) and the run resumes
from its last checkpoint; its metric points are idempotent per step, so none is lost or duplicated. A cancel in
the dashboard is `scancel`. While the Slurm job exists this watcher renews the run's lease, so the API's
reconciler does not send it again; a new watcher (after a worker restart) adopts the Slurm job named in
`summary.slurm` instead of submitting another. Every rank's output (`srun --output ...-%t.out`) is recorded as
a `log` artifact of the run.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from plab.settings import get_settings
from workers.client import ApiError, PlabClient

RUNNING = {"RUNNING", "COMPLETING", "CONFIGURING", "STAGE_OUT", "SIGNALING", "RESIZING"}
WAITING = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SUSPENDED", "RESV_DEL_HOLD", "SPECIAL_EXIT"}
REQUEUE = {"PREEMPTED", "NODE_FAIL", "TIMEOUT"}
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", *REQUEUE}
HOLDER = "slurm job {job_id}"  # the run's worker_host while a Slurm job holds it


@dataclass
class SlurmOptions:
    """`plab worker --launcher slurm` options, passed to the pool processes as PLAB_SLURM_* variables."""
    partition: str | None = None
    account: str | None = None
    time_limit: str | None = None      # sbatch --time, e.g. 04:00:00
    gpus: bool = True                  # ask for --gpus-per-node (False: CPU nodes, gloo processes)
    extra: list[str] = field(default_factory=list)
    poll_s: float = 5.0

    @classmethod
    def from_env(cls) -> "SlurmOptions":
        env = os.environ
        return cls(partition=env.get("PLAB_SLURM_PARTITION") or None, account=env.get("PLAB_SLURM_ACCOUNT") or None,
                   time_limit=env.get("PLAB_SLURM_TIME") or None, gpus=env.get("PLAB_SLURM_GPUS", "1") != "0",
                   extra=shlex.split(env.get("PLAB_SLURM_EXTRA", "")),
                   poll_s=float(env.get("PLAB_SLURM_POLL_S", "5")))

    def to_env(self) -> dict[str, str]:
        return {"PLAB_LAUNCHER": "slurm", "PLAB_SLURM_PARTITION": self.partition or "",
                "PLAB_SLURM_ACCOUNT": self.account or "", "PLAB_SLURM_TIME": self.time_limit or "",
                "PLAB_SLURM_GPUS": "1" if self.gpus else "0", "PLAB_SLURM_EXTRA": shlex.join(self.extra),
                "PLAB_SLURM_POLL_S": str(self.poll_s)}


def batch_script(run_id: int, nodes: int, gpus: int, log_dir: Path, opts: SlurmOptions, python: str) -> str:
    """The sbatch script of one run."""
    lines = ["#!/bin/bash", f"#SBATCH --job-name=plab-run-{run_id}", f"#SBATCH --nodes={nodes}",
             "#SBATCH --ntasks-per-node=1", "#SBATCH --requeue", "#SBATCH --open-mode=append",
             f"#SBATCH --output={log_dir}/run-{run_id}-slurm-%j.out"]
    if opts.partition:
        lines.append(f"#SBATCH --partition={opts.partition}")
    if opts.account:
        lines.append(f"#SBATCH --account={opts.account}")
    if opts.time_limit:
        lines.append(f"#SBATCH --time={opts.time_limit}")
    if opts.gpus:
        lines.append(f"#SBATCH --gpus-per-node={gpus}")
    lines += [f"#SBATCH {arg}" for arg in opts.extra]
    lines += [
        "set -euo pipefail",
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        # The first node's address (NodeAddr), which resolves even where node names are not host names.
        'addr=$(scontrol show node "$head" -o | sed -n "s/.*NodeAddr=\\([^ ]*\\).*/\\1/p")',
        'port=$((20000 + SLURM_JOB_ID % 20000))',
        f"srun --kill-on-bad-exit=1 --output={log_dir}/run-{run_id}-slurm-%j-rank%t.out "
        f"{shlex.quote(python)} -m torch.distributed.run --nnodes=\"$SLURM_NNODES\" --nproc-per-node={gpus} "
        "--rdzv-backend=c10d --rdzv-endpoint=\"$addr:$port\" --rdzv-id=\"$SLURM_JOB_ID\" "
        f"-m workers.jobs.train {run_id}",
    ]
    return "\n".join(lines) + "\n"


def _run(cmd: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def submit(script: str, env: dict[str, str], workdir: Path) -> str:
    """sbatch the script; the Slurm job id."""
    path = workdir / "plab-slurm-job.sh"
    path.write_text(script)
    proc = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True, env=env, timeout=60,
                          cwd=workdir)
    if proc.returncode != 0:
        raise RuntimeError(f"sbatch refused the job: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout.strip().split(";")[0]


def job_state(job_id: str) -> tuple[str | None, str | None]:
    """(state, reason) of a Slurm job; (None, None) once Slurm has forgotten it."""
    proc = _run(["scontrol", "show", "job", "-o", job_id])
    if proc.returncode != 0:
        return None, None
    state = re.search(r"\bJobState=(\S+)", proc.stdout)
    reason = re.search(r"\bReason=(\S+)", proc.stdout)
    return (state.group(1) if state else None), (reason.group(1) if reason else None)


def cancel(job_id: str) -> None:
    _run(["scancel", job_id])


def requeue(job_id: str) -> bool:
    return _run(["scontrol", "requeue", job_id]).returncode == 0


class SlurmRun:
    """Watches one run's Slurm job from submission (or adoption) to the run's outcome."""

    def __init__(self, client: PlabClient, run_id: int, opts: SlurmOptions, max_attempts: int,
                 env: dict[str, str] | None = None):
        self.client, self.run_id, self.opts, self.max_attempts = client, run_id, opts, max_attempts
        self.env = dict(env if env is not None else os.environ)
        self.home = get_settings().home
        self.log_dir = self.home / "runs" / str(run_id) / "logs"
        self.requeues = 0
        self.last_report = None
        self.dispatch = None  # the run's dispatch this supervisor acts for (`start`)

    def start(self, record: dict) -> str:
        """The Slurm job of this run: the one its summary names if Slurm still has it, else a new one."""
        self.dispatch = record.get("dispatched_at")
        known = ((record.get("summary") or {}).get("slurm") or {}).get("job_id")
        if known:
            state, _ = job_state(str(known))
            if state is not None and state not in ENDED:
                return str(known)
        training = (record.get("spec") or {}).get("training") or {}
        self.log_dir.mkdir(parents=True, exist_ok=True)
        import sys
        script = batch_script(self.run_id, int(training.get("nodes") or 1), int(training.get("gpus") or 1),
                              self.log_dir, self.opts, sys.executable)
        job_id = submit(script, self.env, self.log_dir)
        self._report(job_id, "SUBMITTED", None)
        return job_id

    def _report(self, job_id: str, state: str, reason: str | None) -> None:
        if (state, reason) == self.last_report:
            return
        self.last_report = (state, reason)
        try:
            self.client.update_run(self.run_id, summary={"slurm": {"job_id": job_id, "state": state,
                                                                   "reason": reason, "requeues": self.requeues}})
        except ApiError as e:
            print(f"[plab] run {self.run_id}: could not record Slurm state {state}: {e}", flush=True)

    def watch(self, job_id: str) -> str:
        """Until the run has an outcome; returns it."""
        while True:
            state, reason = job_state(job_id)
            base = (state or "GONE").split("+")[0]
            run = self.client.get_run(self.run_id)
            if self._sent_again(run, job_id):
                return run["status"]
            self._report(job_id, base, reason)
            if run["cancel_requested"] and base not in ENDED and state is not None:
                cancel(job_id)
            if base in WAITING or base in RUNNING:
                self._renew(run)
            elif base in REQUEUE and run["status"] in ("queued", "running") and not run["cancel_requested"]:
                if self.requeues + 1 < self.max_attempts and requeue(job_id):
                    self.requeues += 1
                    continue
                return self._finish(job_id, f"the Slurm job ended {base} and was requeued {self.requeues} times "
                                            f"(PLAB_MAX_ATTEMPTS={self.max_attempts})")
            elif base in ENDED or state is None:
                return self._finish(job_id, f"the Slurm job ended {base}" + (f" ({reason})" if reason and
                                                                             reason != "None" else ""))
            time.sleep(self.opts.poll_s)

    def _renew(self, run: dict) -> None:
        """Keep the lease of a run whose Slurm job exists (pending or starting), so it is not sent again."""
        if run["status"] == "running":
            try:
                self.client.heartbeat(self.run_id)
            except ApiError:
                pass

    def _sent_again(self, run: dict, job_id: str) -> bool:
        """Whether the run was sent to the queue again since this supervisor started (a retry of the run while its
        old Slurm job completed): its new job's supervisor acts for it, and this one stops without a report."""
        if run.get("dispatched_at") == self.dispatch:
            return False
        print(f"[plab] run {self.run_id}: sent to the queue again since Slurm job {job_id} started; "
              f"no longer watching it", flush=True)
        return True

    def _finish(self, job_id: str, how: str) -> str:
        self._record_logs(job_id)
        run = self.client.get_run(self.run_id)
        if self._sent_again(run, job_id):
            return run["status"]
        if run["status"] in ("queued", "running"):
            outcome = "cancelled" if run["cancel_requested"] else "failed"
            message = None if outcome == "cancelled" else f"{how} without the run reporting a result; see its logs"
            self.client.set_status(self.run_id, outcome, error_message=message)
            return outcome
        return run["status"]

    def _record_logs(self, job_id: str) -> None:
        from plab.settings import portable_path

        for path in sorted(self.log_dir.glob(f"run-{self.run_id}-slurm-{job_id}*.out")):
            rank = re.search(r"rank(\d+)\.out$", path.name)
            try:
                self.client.add_artifact(self.run_id, "log", portable_path(path, self.home),
                                         meta={"slurm_job_id": job_id, "rank": int(rank.group(1)) if rank else None})
            except ApiError as e:
                print(f"[plab] run {self.run_id}: could not record log {path}: {e}", flush=True)


def run_train(run_id: int, max_attempts: int, env: dict[str, str]) -> int:
    """The Celery task's body under `--launcher slurm`: submit (or adopt) the run's Slurm job and watch it."""
    from workers.jobs import EXIT_OK, EXIT_SKIPPED, UNREPORTED

    with PlabClient.from_env(retries=60) as client:
        record = client.get_run(run_id)
        if record["status"] not in UNREPORTED or record["cancel_requested"]:
            return EXIT_SKIPPED
        slurm = SlurmRun(client, run_id, SlurmOptions.from_env(), max_attempts, env)
        slurm.watch(slurm.start(record))
    return EXIT_OK
