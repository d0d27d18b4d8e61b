"""One training job, run in its own process by the Celery task (or by torchrun for multi-GPU jobs).

    python -m workers.job RUN_ID

It fetches the run through the API, trains with `training.launch.run`, streams metrics through the API client from
a background thread, and reports the final status. A separate process per job gives each job a clean CUDA
context and memory, lets torchrun own multi-GPU jobs, and keeps a crash from taking the worker down.
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import traceback

from backend.settings import get_settings
from training.sink import MetricSink
from workers.client import ApiError, MetricStreamer, PlabClient

EXIT_OK, EXIT_SKIPPED = 0, 3



class ApiSink(MetricSink):
    """training.sink.MetricSink that forwards to the API (non-blocking: the streamer's thread does the I/O)."""

    def __init__(self, client: PlabClient, run_id: int, streamer: MetricStreamer | None):
        self.client, self.run_id, self.streamer = client, run_id, streamer

    def log(self, step: int, metrics: dict, *, tokens: int, wall_time: float) -> None:
        if self.streamer is not None:
            self.streamer.log(step, metrics, tokens=tokens, wall_time=wall_time)

    def event(self, kind: str, **fields) -> None:
        if self.streamer is None:
            return
        try:
            if kind == "conversion_report":
                report = fields.get("report") or {}
                self.client.update_run(self.run_id, conversion_report=report,
                                       gemm_backend=report.get("gemm_backend"))
            elif kind == "checkpoint":
                self.client.add_artifact(self.run_id, "checkpoint", str(fields.get("path")), step=fields.get("step"),
                                         meta={k: v for k, v in fields.items() if k not in ("path", "step")})
        except (ApiError, OSError) as e:  # reporting must never kill a training job
            print(f"[plab] could not report {kind}: {e}", file=sys.stderr)

    def flush(self) -> None:
        if self.streamer is not None:
            self.streamer.flush()

    def close(self) -> None:
        pass


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"cpu ({os.cpu_count()} cores)"


def validation_text(spec: dict, out: "os.PathLike", max_tokens: int = 400_000) -> str | None:
    """The experiment's held-out text (the validation split the loop reports val/loss on), decoded from its
    token shard, for the held-out bits-per-byte task. None for synthetic corpora."""
    from pathlib import Path

    from training.config import RunSpec, plab_home
    from training.data import TokenDataset
    from training.tokenizer import get_tokenizer

    rs = RunSpec.from_dict(spec)
    corpus = rs.data.corpus_dir()
    if corpus is None:
        return None
    out = Path(out)
    if not out.is_file():
        tok = get_tokenizer(corpus, rs.data.vocab_size, plab_home() / "cache")
        ds = TokenDataset.from_corpus(corpus, tok, seq_len=rs.data.seq_len, val_fraction=rs.data.val_fraction,
                                      cache_dir=plab_home() / "cache")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(tok.decode(ds.val[:max_tokens].tolist()))
        tmp.replace(out)
    return str(out)


def run_evaluation(evaluation_id: int) -> int:
    """Evaluate a run's checkpoint with lm-eval; each task's result is posted as soon as it is done."""
    from training.evaluation import evaluate_checkpoint

    settings = get_settings()
    client = PlabClient(settings.api_url, settings.api_token)
    job = client._request("GET", f"/evaluations/{evaluation_id}/job")
    if job["status"] not in ("queued", "running"):
        print(f"[plab] evaluation {evaluation_id} is '{job['status']}'; nothing to do")
        return EXIT_SKIPPED
    client._request("POST", f"/evaluations/{evaluation_id}/status", json={"status": "running"})
    try:
        heldout = None
        if any("heldout" in t for t in job["tasks"]):
            heldout = validation_text(job["spec"], settings.home / "runs" / str(job["run_id"]) / "validation.txt")

        def post(task: str, result: dict) -> None:
            client._request("POST", f"/evaluations/{evaluation_id}/results", json={"task": task, "result": result})

        posted: set[str] = set()

        def post_once(task: str, result: dict) -> None:
            post(task, result)
            posted.add(task)

        result = evaluate_checkpoint(job["checkpoint"], job["tasks"], limit=job["limit"], heldout_text=heldout,
                                     on_task_done=post_once)
        # A group (e.g. plab_blimp) carries no per-document scores itself: its subtasks do, and the paired
        # comparison with BF16 needs them, so they are stored too.
        for task, entry in (result.get("tasks") or {}).items():
            if task not in posted:
                post_once(task, entry)
    except BaseException as e:  # noqa: BLE001 - reported, then re-raised as an exit code
        tb = "".join(traceback.format_exception(e)[-6:])
        client._request("POST", f"/evaluations/{evaluation_id}/status",
                        json={"status": "failed", "error_message": f"{type(e).__name__}: {e}\n\n{tb}"[:100_000]})
        raise
    client._request("POST", f"/evaluations/{evaluation_id}/status",
                    json={"status": "succeeded", "lm_eval_version": result.get("lm_eval_version")})
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "eval":
        return run_evaluation(int(argv[1]))
    run_id = int(argv[0])
    settings = get_settings()
    rank = int(os.environ.get("RANK", "0"))
    client = PlabClient(settings.api_url, settings.api_token)
    run = client.get_run(run_id)
    if run["status"] not in ("queued", "running") or run["cancel_requested"]:
        print(f"[plab] run {run_id} is '{run['status']}'; nothing to do")
        return EXIT_SKIPPED

    from training.config import RunSpec
    from training import launch

    stop = threading.Event()
    streamer = client.stream(run_id, on_cancel=stop.set) if rank == 0 else None
    if rank == 0:
        client.set_status(run_id, "running", worker_host=socket.gethostname(), device_name=device_name())
    sink = ApiSink(client, run_id, streamer)
    output_dir = settings.home / "runs" / str(run_id)
    try:
        spec = RunSpec.from_dict(run["spec"])
        result = launch.run(spec, sink, should_stop=stop.is_set, output_dir=output_dir, resume=True)
    except BaseException as e:  # noqa: BLE001 - every failure is reported, then re-raised as an exit code
        if streamer is not None:
            streamer.close()
        if rank == 0:
            tb = "".join(traceback.format_exception(e)[-6:])
            client.set_status(run_id, "failed", error_message=f"{type(e).__name__}: {e}\n\n{tb}"[:100_000])
        raise
    if streamer is not None:
        streamer.close()
    if rank == 0:
        summary = dict(result.summary or {})
        summary.update({"final_loss": result.final_loss, "final_val_loss": result.final_val_loss,
                        "steps": result.steps, "tokens": result.tokens})
        if result.checkpoint_dir:  # before the final status: a succeeded run may be evaluated at once
            client.add_artifact(run_id, "checkpoint", str(result.checkpoint_dir), step=result.steps,
                                meta={"format": "hf", "final": True})
        client.set_status(run_id, result.status, diverged_step=result.diverged_step, summary=summary,
                          gemm_backend=result.gemm_backend, device_name=result.device_name)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
