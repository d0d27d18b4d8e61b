"""lm-evaluation-harness adapter: evaluate an HF-format checkpoint on named tasks.

The result is one JSON-able dict (see :func:`evaluate_checkpoint`) holding, per task, every
metric with its standard error, the lm-eval version, the task hash lm-eval itself writes
(``task_hashes`` in its results JSON), a digest of the resolved task config, the per-sample
scores needed for paired comparisons (:mod:`training.evaluation.stats`) and the wall time.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import difflib
import hashlib
import json
import logging
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from .limits import document_limit
from .taskdirs import (
    DEFAULT_HELDOUT_RELPATH,
    SHIPPED_TASKS,
    SHIPPED_TASKS_DIR,
    TaskConfigError,
    render_task_dirs,
    user_task_dirs,
)

log = logging.getLogger(__name__)

_DTYPES = ("auto", "float32", "bfloat16", "float16")


class EvaluationError(ValueError):
    """Bad input to the evaluation adapter; the message says what to change."""


# --------------------------------------------------------------------------- task listing


def list_tasks(tasks_dir: str | os.PathLike | None = None, *, include_lm_eval: bool = False) -> list[dict]:
    """Every task and group `evaluate_checkpoint` can run, sorted by name.

    Each entry: ``name``, ``kind`` (``task``|``group``|``tag``, or ``invalid`` with an
    ``error`` for a user YAML lm-eval cannot read), ``source`` (``shipped``,
    ``user`` or ``lm_eval``), ``path`` (the YAML), ``output_type`` (tasks), ``subtasks``
    (groups), ``groups`` (the shipped/user groups a task belongs to). ``include_lm_eval``
    adds lm-eval's built-in tasks (thousands; they need the Hugging Face Hub or its cache).
    """
    from lm_eval.tasks._index import Kind, TaskIndex
    from lm_eval.tasks._yaml_loader import load_yaml

    sources = [("shipped", SHIPPED_TASKS_DIR)] + [("user", d) for d in user_task_dirs(tasks_dir)]
    entries: dict[str, dict] = {}
    if include_lm_eval:
        import lm_eval.tasks as lm_tasks

        sources.insert(0, ("lm_eval", Path(lm_tasks.__file__).parent))
    for source, root in sources:
        # One index per root so a user task that shadows a shipped one is reported as "user".
        for name, entry in TaskIndex.build([root]).items():
            cfg = entry.cfg or {}
            item = {
                "name": name,
                "kind": {Kind.GROUP: "group", Kind.TAG: "tag"}.get(entry.kind, "task"),
                "source": source,
                "path": str(entry.yaml_path) if entry.yaml_path else None,
            }
            if item["kind"] == "task":
                item["output_type"] = cfg.get("output_type", "generate_until")
            if item["kind"] == "group":
                item["subtasks"] = [t if isinstance(t, str) else t.get("task") for t in cfg.get("task", [])]
            if item["kind"] == "tag":
                item["subtasks"] = sorted(entry.tags)
            entries[name] = item
    for root in user_task_dirs(tasks_dir):
        # lm-eval's indexer skips a YAML it cannot parse without a word; a user who just
        # dropped one in needs to see why it is missing.
        for path in sorted(root.rglob("*.yaml")):
            try:
                cfg = load_yaml(path, resolve_func=False)
                TaskIndex._kind_of(cfg)
            except Exception as err:  # noqa: BLE001 - any parse error is reported, not raised
                entries[f"!{path}"] = {"name": path.stem, "kind": "invalid", "source": "user", "path": str(path), "error": str(err)}
    for item in entries.values():
        if item["kind"] == "group" and item["source"] != "lm_eval":
            for sub in item["subtasks"]:
                if sub in entries:
                    entries[sub].setdefault("groups", []).append(item["name"])
    return sorted(entries.values(), key=lambda e: e["name"])


# --------------------------------------------------------------------------- evaluation


def evaluate_checkpoint(
    checkpoint_dir: str | os.PathLike,
    tasks: str | Sequence[str] = SHIPPED_TASKS,
    *,
    limit: int | float | None = None,
    device: str = "auto",
    batch_size: int | str | None = None,
    dtype: str = "auto",
    tasks_dir: str | os.PathLike | None = None,
    data_dir: str | os.PathLike | None = None,
    heldout_text: str | os.PathLike | None = None,
    offline: bool = True,
    bootstrap_iters: int = 100_000,
    on_task_done: Callable[[str, dict], None] | None = None,
    rolling_context: int | None = None,
) -> dict:
    """Evaluate the HF checkpoint in ``checkpoint_dir`` (model + its own tokenizer) with lm-eval.

    ``tasks``: task or group names (a list, or one comma-separated string): the shipped ``plab_*`` tasks, tasks in
    ``tasks_dir``/``PLAB_EVAL_TASKS_DIR``, or lm-eval's own (those need their dataset in the HF cache when
    ``offline``). ``limit``: documents per task (an int, or a fraction in (0, 1)), for tests. ``device``: ``auto``
    (CUDA when present), ``cpu``, ``cuda`` or ``cuda:N``. ``dtype``: ``auto`` is bfloat16 on CUDA and float32 on CPU.
    ``batch_size``: an int or ``"auto"``; default 64 on CUDA, 8 on CPU. ``bootstrap_iters``: lm-eval's (its CLI uses
    100,000; only perplexity-type stderrs use it). ``on_task_done`` is called as ``on_task_done(name, task_result)``
    after each requested task, e.g. to store results as they arrive. ``rolling_context``: the window length of perplexity-type tasks
    (``loglikelihood_rolling``: ``plab_heldout_bpb``); default: the context the checkpoint records it was trained
    on (config.json's ``plab_trained_context``), else lm-eval's max_length. ``heldout_text``: ``plab_heldout_bpb``'s
    text; default ``PLAB_EVAL_HELDOUT_TEXT``, else the run's own validation text (``_from_run_spec``).

    Each requested task runs as its own ``simple_evaluate`` call on one loaded model, which
    is what gives a wall time per task; lm-eval computes each request independently of
    which other tasks run, so the numbers are those of a single combined run.

    Returns ``{"lm_eval_version", "checkpoint_dir", "model_args", "device", "dtype",
    "batch_size", "limit", "bootstrap_iters", "started_at", "load_time_s", "total_time_s",
    "requested": [...], "tasks": {name: task_result}}`` where a task_result is
    ``{"kind": "task"|"group", "metrics": {metric: {"value", "stderr"}}, "aggregation":
    {metric: name}, "higher_is_better": {metric: bool}, "n_samples", "n_docs", "version",
    "task_hash", "config_digest", "samples": {"doc_id": [...], metric: [...]}, "time_s",
    "group"}``; groups carry ``subtasks`` instead of ``samples``. Per-sample values are
    0/1 for accuracies, the log-likelihood for ``perplexity``, and ``[loglikelihood,
    weight]`` pairs for ``bits_per_byte``/``*_perplexity``. ``time_s`` is null for a subtask
    that ran inside its group's time.
    """
    checkpoint = _check_checkpoint(checkpoint_dir)
    requested = _check_task_names(tasks)
    limit = _check_limit(limit)
    resolved_device = _resolve_device(device)
    resolved_dtype = _resolve_dtype(dtype, resolved_device)
    batch_size = _resolve_batch_size(batch_size, resolved_device)
    _check_options(bootstrap_iters, on_task_done, rolling_context)

    heldout_text, rolling_context = _from_run_spec(checkpoint, requested, heldout_text, rolling_context)
    _warn_default_heldout(requested, heldout_text)
    started_at = _dt.datetime.now(_dt.timezone.utc).isoformat()
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="plab-eval-tasks-") as tmp, _lm_eval_environment(offline):
        manager, needs_builtin = _task_manager(requested, Path(tmp) / "tasks", data_dir=data_dir,
                                               heldout_text=heldout_text, tasks_dir=tasks_dir)
        import lm_eval

        model_args = f"pretrained={checkpoint},tokenizer={checkpoint},dtype={resolved_dtype}"
        t_load = time.perf_counter()
        lm = _load_model(model_args, batch_size=batch_size, device=resolved_device)
        rolling_context = _window_rolling_tasks(lm, rolling_context or trained_context(checkpoint))
        load_time = time.perf_counter() - t_load

        out_tasks: dict[str, dict] = {}
        settings = {"dtype": resolved_dtype, "lm_eval_version": lm_eval.__version__, "rolling_context": rolling_context}
        for name in requested:
            out_tasks.update(_evaluate_task(lm, name, manager, builtin=name in needs_builtin, limit=limit,
                                            bootstrap_iters=bootstrap_iters, offline=offline, settings=settings))
            if on_task_done is not None:
                on_task_done(name, out_tasks[name])

    return {"lm_eval_version": lm_eval.__version__, "checkpoint_dir": str(checkpoint), "model_args": model_args,
            "device": resolved_device, "dtype": resolved_dtype, "batch_size": batch_size, "limit": limit,
            "bootstrap_iters": bootstrap_iters, "started_at": started_at, "load_time_s": load_time,
            "total_time_s": time.perf_counter() - t_start, "requested": requested, "tasks": out_tasks}


def _check_options(bootstrap_iters, on_task_done, rolling_context) -> None:
    if not isinstance(bootstrap_iters, int) or bootstrap_iters < 0:
        raise EvaluationError(f"bootstrap_iters must be an integer >= 0 (0 skips stderrs), got {bootstrap_iters!r}")
    if on_task_done is not None and not callable(on_task_done):
        raise EvaluationError("on_task_done must be callable as on_task_done(task_name, task_result)")
    if rolling_context is not None and (isinstance(rolling_context, bool) or not isinstance(rolling_context, int)
                                        or rolling_context < 2):
        raise EvaluationError(f"rolling_context must be a whole number of tokens >= 2 (the window of perplexity "
                              f"tasks), got {rolling_context!r}")


def _from_run_spec(checkpoint: Path, requested: list[str], heldout_text, rolling_context) -> tuple:
    """(heldout_text, rolling_context) for plab_heldout_bpb where the caller gave neither: what the run spec of a
    checkpoint folder of the lab (its run_spec.json) says - the run's validation text, and the context it trained
    on for a checkpoint written before config.json recorded it. Unchanged for any other folder."""
    needs_text = heldout_text is None and not os.environ.get("PLAB_EVAL_HELDOUT_TEXT")
    needs_context = rolling_context is None and trained_context(checkpoint) is None
    if "plab_heldout_bpb" not in requested or not (needs_text or needs_context):
        return heldout_text, rolling_context
    from .heldout import checkpoint_spec, trained_context as spec_context

    spec = checkpoint_spec(checkpoint)
    if spec is None:
        return heldout_text, rolling_context
    return (_heldout_of_run(spec) if needs_text else heldout_text,
            spec_context(spec) if needs_context else rolling_context)


def _heldout_of_run(spec: dict) -> str | None:
    """The run's own validation text (as the worker scores it), made from its token shards into PLAB_HOME's cache;
    None (the default text, with its warning) where the run's data cannot be opened here."""
    from .heldout import validation_text

    print(f"plab eval: plab_heldout_bpb scores the run's own validation text: reading the run's data "
          f"({spec['data'].get('corpus')}; tokenized first where this machine has no token cache of it)",
          file=sys.stderr, flush=True)
    try:
        path = validation_text(spec)
    except Exception as e:  # noqa: BLE001 - a corpus moved or missing here: say so and keep the default
        print(f"plab eval: the checkpoint's run spec names data this machine cannot open ({e}); plab_heldout_bpb "
              f"falls back to the default text", file=sys.stderr)
        return None
    if path is not None:
        print(f"plab eval: plab_heldout_bpb scores the run's own validation text (the checkpoint's run_spec.json, "
              f"data.val_windows as it trained): {path}", file=sys.stderr)
    return path


def _warn_default_heldout(requested: list[str], heldout_text) -> None:
    """The worker passes the run's own validation split; by hand the default is a whole corpus file, which a run
    trained on that corpus has mostly seen (Tiny Shakespeare: all but its last ~2%): say so."""
    if "plab_heldout_bpb" in requested and heldout_text is None and not os.environ.get("PLAB_EVAL_HELDOUT_TEXT"):
        print(f"plab eval: plab_heldout_bpb scores {DEFAULT_HELDOUT_RELPATH} whole (no --heldout-text): for a run "
              "trained on that corpus most of it is training text, not held out; give the run's validation text "
              "with --heldout-text for a held-out figure (a checkpoint folder of the lab - with its "
              "run_spec.json - gets it made from the run's spec; the worker keeps it in "
              "PLAB_HOME/runs/<id>/validation_spread.txt)", file=sys.stderr)


def _task_manager(requested: list[str], render_dir: Path, *, data_dir, heldout_text, tasks_dir):
    """Renders our task YAMLs into `render_dir`; returns (an lm-eval TaskManager that knows every requested
    task, the requested names only lm-eval itself has). Raises EvaluationError naming unknown tasks."""
    from lm_eval.tasks import TaskManager

    try:
        rendered = render_task_dirs(render_dir, data_dir=data_dir, heldout_text=heldout_text, tasks_dir=tasks_dir)
    except TaskConfigError as err:
        raise EvaluationError(str(err)) from err
    ours = TaskManager(include_path=[str(p) for p in rendered.include_paths], include_defaults=False)
    needs_builtin = [name for name in requested if name not in ours.all_tasks]
    ours_missing = [name for name in needs_builtin if name.startswith("plab_")]
    if ours_missing:
        # The plab_ prefix is ours alone: no need to index lm-eval's ~15k tasks (15 s) to
        # know these do not exist.
        raise EvaluationError(_unknown_tasks_message(ours_missing, ours.all_tasks))
    manager = ours
    if needs_builtin:
        manager = TaskManager(include_path=[str(p) for p in rendered.include_paths], include_defaults=True)
        unknown = [name for name in needs_builtin if name not in manager.all_tasks]
        if unknown:
            raise EvaluationError(_unknown_tasks_message(unknown, manager.all_tasks))
    _check_placeholders(requested, manager, rendered)
    return manager, needs_builtin


def _load_model(model_args: str, *, batch_size, device: str):
    """lm-eval's HF model, built once the way simple_evaluate builds it from the same model_args string, and
    reused for every task so only the first task pays for loading the model."""
    from lm_eval.api.registry import get_model

    return get_model("hf").create_from_arg_string(
        model_args, {"batch_size": batch_size, "max_batch_size": None, "device": device}
    )


def trained_context(checkpoint: Path) -> int | None:
    """The longest context the checkpoint's model was trained on, as its config.json records it
    (training.model.TRAINED_CONTEXT_ATTR); None for a checkpoint that does not say (a pretrained model's own)."""
    from training.model import TRAINED_CONTEXT_ATTR

    try:
        value = json.loads((checkpoint / "config.json").read_text()).get(TRAINED_CONTEXT_ATTR)
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _window_rolling_tasks(lm, context: int | None) -> int:
    """Perplexity-type tasks (lm-eval's loglikelihood_rolling: plab_heldout_bpb, wikitext, ...) score a text in
    windows of the model's max_length; for a model trained on shorter sequences that put most tokens at positions
    it never learned (bits per byte 2.5% worse at 2048 than at its 128 for the demo's model). Their windows are
    `context` (the trained context) when known; multiple-choice and loglikelihood tasks keep lm-eval's
    max_length (an ending longer than the trained context must still be scored whole). Returns the rolling
    tasks' window length."""
    if context is None or context >= lm.max_length:
        return lm.max_length
    rolling = lm.loglikelihood_rolling

    def windowed(requests, *args, **kwargs):
        before = lm._max_length
        lm._max_length = context
        try:
            return rolling(requests, *args, **kwargs)
        finally:
            lm._max_length = before
    lm.loglikelihood_rolling = windowed
    return context


def _evaluate_task(lm, name: str, manager, *, builtin: bool, limit, bootstrap_iters: int,
                   offline: bool, settings: dict) -> dict[str, dict]:
    """One requested task (with its subtasks, for a group) on the loaded model: {task name: task_result},
    the requested one timed, each with `settings` as its eval_settings: what its scores depend on besides the
    checkpoint and the documents (the paired comparison refuses two results scored in different dtypes:
    training.evaluation.stats.check_same_documents)."""
    import jinja2  # lm-eval's templates
    import lm_eval

    t_task = time.perf_counter()
    try:
        raw = lm_eval.simple_evaluate(
            model=lm,
            tasks=[name],
            task_manager=manager,
            limit=limit,
            log_samples=True,
            bootstrap_iters=bootstrap_iters,
        )
    except jinja2.TemplateError as err:  # a user task's template names a field its documents lack, say
        raise EvaluationError(f"task {name!r}: its prompt template failed ({type(err).__name__}: {err}); check its "
                              "YAML's doc_to_text / doc_to_target / doc_to_choice against the fields its documents "
                              "have") from err
    except ConnectionError as err:
        if not builtin:
            raise
        raise EvaluationError(
            f"lm-eval task {name!r} needs its dataset from the Hugging Face Hub ({err}); "
            + ("it is not in the local cache and evaluation runs offline: pass offline=False "
               "(plab eval --online) on a machine that can reach the Hub, or use a plab_* task"
               if offline else "the Hub could not be reached")
        ) from err
    elapsed = time.perf_counter() - t_task
    converted = _convert_results(raw, {g: _group_aggregates(manager, g) for g in raw.get("group_subtasks", {})})
    from .stats import ROLLING_METRICS

    for task_name, task_result in converted.items():
        task_result["time_s"] = elapsed if task_name == name else None
        rolling = any(m in (task_result.get("metrics") or {}) for m in ROLLING_METRICS)
        # the window length only where texts were scored in windows (a multiple-choice task used max_length)
        task_result["eval_settings"] = {k: v for k, v in settings.items() if rolling or k != "rolling_context"}
    return converted


def task_hash(samples: Iterable[dict]) -> str:
    """lm-eval's task hash (EvaluationTracker): sha256 over doc, prompt and target hashes in order."""
    joined = "".join(s["doc_hash"] + s["prompt_hash"] + s["target_hash"] for s in samples)
    return hashlib.sha256(joined.encode("utf-8")).hexdigest()


def _group_aggregates(manager, group: str) -> dict[str, bool] | None:
    """{metric: weight_by_size} of a group's `aggregate_metric_list` in its YAML as lm-eval's task index holds
    it (lm-eval's defaults: weighted by size), {} for a group lm-eval gives no score; None where the index has no
    config for it (a group defined inline in another group's YAML)."""
    entry = manager.task_index.get(group)
    cfg = getattr(entry, "cfg", None)
    if not isinstance(cfg, dict):
        return None
    listed = cfg.get("aggregate_metric_list") or []
    if isinstance(listed, dict):
        listed = [listed]
    return {m["metric"]: bool(m.get("weight_by_size", True)) for m in listed
            if isinstance(m, dict) and isinstance(m.get("metric"), str)}


def _convert_results(raw: dict, group_aggregates: dict[str, dict[str, bool] | None] | None = None) -> dict[str, dict]:
    """lm-eval's results dict → our compact per-task records (leaf tasks, then groups). `group_aggregates`:
    each group's {metric: weight_by_size} (`_group_aggregates`); a group without one is aggregated, unweighted,
    over every metric of its first subtask, as records stored before it were."""
    configs = raw.get("configs", {})
    samples = raw.get("samples", {})
    out: dict[str, dict] = {}
    group_of = {sub: group for group, subs in raw.get("group_subtasks", {}).items() for sub in subs}
    for name, cfg in configs.items():
        metric_list = cfg.get("metric_list") or []
        aggregation = {m["metric"]: _aggregation_name(m.get("aggregation")) for m in metric_list if isinstance(m.get("metric"), str)}
        task_samples = sorted(samples.get(name, []), key=lambda s: int(s["doc_id"]))
        per_sample: dict[str, list] = {"doc_id": [int(s["doc_id"]) for s in task_samples]}
        for metric in aggregation:
            per_sample[metric] = [_sample_value(s.get(metric)) for s in task_samples]
        n = raw.get("n-samples", {}).get(name, {})
        out[name] = {
            "kind": "task",
            "group": group_of.get(name),
            "metrics": _metrics(raw["results"].get(name, {})),
            "aggregation": aggregation,
            "higher_is_better": dict(raw.get("higher_is_better", {}).get(name, {})),
            "n_samples": n.get("effective", len(task_samples)),
            "n_docs": n.get("original"),
            "version": raw.get("versions", {}).get(name),
            "task_hash": task_hash(task_samples),
            "config_digest": _digest(cfg),
            "samples": per_sample,
        }
    group_subtasks = {g: list(subs) for g, subs in raw.get("group_subtasks", {}).items() if subs}
    for group in _children_first(group_subtasks):
        subtasks = group_subtasks[group]
        leafs = [out[s] for s in subtasks if s in out]
        listed = (group_aggregates or {}).get(group)
        if listed is None:
            aggregation, by_size = ({m: "mean" for m in leafs[0]["aggregation"]} if leafs else {}), {}
        else:
            # The metrics lm-eval scores the group on (e.g. MMLU: acc only), each with its weighting.
            known = {m for t in leafs for m in t["aggregation"]}
            aggregation = {m: "mean" for m in listed if m in known}
            by_size = {m: listed[m] for m in aggregation}
        out[group] = {
            "kind": "group",
            "group": group_of.get(group),
            "subtasks": list(subtasks),
            "metrics": _metrics(raw.get("groups", {}).get(group, {})),
            "aggregation": aggregation,
            "weight_by_size": by_size,
            "higher_is_better": dict(raw.get("higher_is_better", {}).get(group, {})),
            "n_samples": sum(t["n_samples"] for t in leafs),
            "n_docs": sum(t["n_docs"] or 0 for t in leafs),
            "version": raw.get("versions", {}).get(group),
            "task_hash": hashlib.sha256("".join(t["task_hash"] for t in leafs).encode()).hexdigest(),
            "config_digest": hashlib.sha256("".join(t["config_digest"] for t in leafs).encode()).hexdigest(),
        }
    return out


def _children_first(group_subtasks: dict[str, list[str]]) -> list[str]:
    """The groups in an order where each subgroup comes before the groups that hold it (MMLU: its four
    categories, then MMLU), so a group's record is built from its children's records."""
    order: list[str] = []
    seen: set[str] = set()

    def visit(group: str) -> None:
        if group in seen:
            return
        seen.add(group)
        for sub in group_subtasks[group]:
            if sub in group_subtasks:
                visit(sub)
        order.append(group)

    for group in group_subtasks:
        visit(group)
    return order


def _metrics(entry: dict) -> dict[str, dict]:
    """``{"acc,none": v, "acc_stderr,none": s}`` → ``{"acc": {"value": v, "stderr": s}}``.

    A filter other than ``none`` keeps its name as a suffix (``exact_match/strict``).
    """
    metrics: dict[str, dict] = {}
    for key, value in entry.items():
        if "," not in key or "_stderr," in key:
            continue
        metric, filt = key.split(",", 1)
        name = metric if filt == "none" else f"{metric}/{filt}"
        stderr = entry.get(f"{metric}_stderr,{filt}")
        metrics[name] = {"value": _finite_or_none(value), "stderr": _finite_or_none(stderr)}
    return metrics


def _finite_or_none(value: Any) -> float | None:
    # lm-eval writes "N/A" where it has no stderr (e.g. bits_per_byte) and may produce inf
    # perplexities for an untrained model; JSON (and the database) want null for both.
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _sample_value(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [float(v) for v in value]
    if value is None:
        return None
    return float(value)


def _aggregation_name(agg: Any) -> str | None:
    if agg is None or isinstance(agg, str):
        return agg
    return getattr(agg, "__name__", str(agg))


def _digest(cfg: dict) -> str:
    return hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------- validation


def _check_checkpoint(checkpoint_dir: Any) -> Path:
    if not isinstance(checkpoint_dir, (str, os.PathLike)) or not os.fspath(checkpoint_dir):
        raise EvaluationError(f"checkpoint_dir must be a directory path, got {checkpoint_dir!r}")
    path = Path(checkpoint_dir).expanduser().resolve()
    if path.is_file():
        raise EvaluationError(f"{str(path)!r} is a file; give the checkpoint's folder (the one holding config.json, "
                              f"the weights and the tokenizer), e.g. {str(path.parent)!r}")
    if not path.is_dir():
        raise EvaluationError(f"checkpoint directory {str(path)!r} does not exist")
    if not (path / "config.json").is_file():
        raise EvaluationError(
            f"{str(path)!r} has no config.json: give a Hugging Face checkpoint saved with "
            "save_pretrained (config.json, model weights and tokenizer files)"
        )
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise EvaluationError(
            f"{str(path)!r} has no tokenizer files; save the training tokenizer next to the model "
            "(tokenizer.save_pretrained(dir)) so the evaluation uses the checkpoint's own tokenizer"
        )
    return path


def _check_task_names(tasks: Any) -> list[str]:
    if isinstance(tasks, str):
        names = [t.strip() for t in tasks.split(",")]
    elif isinstance(tasks, Sequence):
        names = list(tasks)
    else:
        raise EvaluationError(f"tasks must be a list of task names or a comma-separated string, got {tasks!r}")
    if not names or any(not isinstance(t, str) or not t.strip() for t in names):
        raise EvaluationError(f"tasks must be non-empty task names, got {tasks!r}; see `plab eval --list-tasks`")
    names = [t.strip() for t in names]
    duplicates = sorted({t for t in names if names.count(t) > 1})
    if duplicates:
        raise EvaluationError(f"task names repeated: {duplicates}; name each task once")
    return names


def _check_limit(limit: Any) -> int | float | None:
    try:
        return document_limit(limit)
    except ValueError as err:
        raise EvaluationError(str(err)) from None


def _resolve_device(device: Any) -> str:
    import torch

    if not isinstance(device, str):
        raise EvaluationError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return device
    if device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit()):
        if not torch.cuda.is_available():
            raise EvaluationError(f"device {device!r} asked for but CUDA is not available here; use 'cpu' or 'auto'")
        if ":" in device and int(device[5:]) >= torch.cuda.device_count():
            raise EvaluationError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
        return device
    raise EvaluationError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")


def _resolve_dtype(dtype: Any, device: str) -> str:
    if dtype not in _DTYPES:
        raise EvaluationError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
    if dtype == "auto":
        # BF16 matches how the checkpoints were trained on GPU; CPU BF16 matmuls are slow
        # and not what the CPU tests want to measure.
        return "bfloat16" if device.startswith("cuda") else "float32"
    return dtype


def _resolve_batch_size(batch_size: Any, device: str) -> int | str:
    if batch_size is None:
        return 64 if device.startswith("cuda") else 8
    if batch_size == "auto":
        return batch_size
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise EvaluationError(f"batch_size must be a positive integer or 'auto', got {batch_size!r}")
    return batch_size


def _unknown_tasks_message(unknown: list[str], known: list[str]) -> str:
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=3)
        hints.append(f"{name!r}" + (f" (did you mean {', '.join(close)}?)" if close else ""))
    return (
        f"unknown task(s): {'; '.join(hints)}. `plab eval --list-tasks` lists the available ones; "
        "a new task is a YAML file in PLAB_EVAL_TASKS_DIR"
    )


def _check_placeholders(requested: list[str], manager: Any, rendered: Any) -> None:
    """Fail before loading the model if a requested task still has an unset ``${VAR}``."""
    if not rendered.unresolved:
        return
    index = manager.task_index
    pending = list(requested)
    seen = set()
    while pending:
        name = pending.pop()
        if name in seen or name not in index:
            continue
        seen.add(name)
        entry = index[name]
        path = Path(entry.yaml_path) if entry.yaml_path else None
        if path in rendered.unresolved:
            source = rendered.sources.get(path, path)
            missing = ", ".join("${" + v + "}" for v in rendered.unresolved[path])
            raise EvaluationError(
                f"task {name!r} ({source}) uses {missing}, which is not set; export the variable "
                "or write the path into the YAML"
            )
        cfg = entry.cfg or {}
        subtasks = cfg.get("task") if entry.kind.name == "GROUP" else None
        if isinstance(subtasks, list):
            pending += [t if isinstance(t, str) else t.get("task") for t in subtasks]
        pending += list(entry.tags) if entry.kind.name == "TAG" else []


@contextlib.contextmanager
def _lm_eval_environment(offline: bool):
    """Set the environment lm-eval runs under for the duration, then restore it.

    Offline: the environment variables only take effect when datasets/huggingface_hub are
    first imported, so the module-level flags of already imported ones are patched too.
    Daemonic processes (Celery's prefork workers) may not start children, which lm-eval's
    bootstrap stderr does through multiprocessing.Pool; DISABLE_MULTIPROC makes it run the
    same seeded resamples in-process, so the stderr is identical.
    """
    import multiprocessing

    wanted = {}
    if offline:
        wanted.update({"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    if multiprocessing.current_process().daemon:
        wanted["DISABLE_MULTIPROC"] = "1"
    saved_env = {k: os.environ.get(k) for k in wanted}
    patched: list[tuple[Any, str, Any]] = []
    for module_name, attrs in (
        ("huggingface_hub.constants", ("HF_HUB_OFFLINE",)),
        ("datasets.config", ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")),
    ):
        module = sys.modules.get(module_name) if offline else None
        for attr in attrs if module is not None else ():
            if hasattr(module, attr):
                patched.append((module, attr, getattr(module, attr)))
                setattr(module, attr, True)
    os.environ.update(wanted)
    _compile_templates_once()
    _skip_environment_report_once()
    try:
        yield
    finally:
        for module, attr, value in patched:
            setattr(module, attr, value)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _compile_templates_once() -> None:
    """Make lm-eval compile each of a task's Jinja templates once instead of once per document.

    `lm_eval.utils.apply_template` (0.4.x) calls `env.from_string(template)` on every call: the doc_to_text,
    doc_to_choice and doc_to_target of every document are parsed and compiled again, ~1 ms per document on a CPU
    core (bench/eval_template_ab.py: BLiMP 1.10x faster with a tiny model on a CPU). The replacement
    keeps the compiled `Template` per template string, from the same environment (same filters,
    `StrictUndefined`), and renders it with the same document, so every prompt is the same string; lm-eval looks
    the function up as `utils.apply_template` at each call, so this reaches every task. Installed once per
    process and left in place: it differs from the original only in not compiling again (so two evaluations in
    one process, e.g. a worker's threads, never restore each other's)."""
    import functools

    from lm_eval import utils

    if getattr(utils.apply_template, "plab_compiles_once", False):
        return
    compile_ = functools.lru_cache(maxsize=4096)(utils.env.from_string)

    def apply_template(template: str, doc: dict) -> str:
        return compile_(template).render(**doc)

    apply_template.plab_compiles_once = True
    apply_template.original = utils.apply_template
    utils.apply_template = apply_template


def _skip_environment_report_once() -> None:
    """Make `simple_evaluate` skip the environment report it appends to every result.

    lm-eval 0.4.x ends each `simple_evaluate` with `get_git_commit_hash()` (`git describe` with the process's stderr,
    so every task printed "fatal: not a git repository" where the process does not run inside a git checkout, as in
    the Docker image) and `add_env_info()` (torch's `collect_env`, which starts pip, nvidia-smi and others: ~0.6 s a
    task on a CPU machine, counted in that task's `time_s`). Neither of their keys reaches our records: `evaluate`
    keeps its own provenance (`lm_eval_version`, model_args, device, dtype) and the run keeps its commit. Installed
    once per process and left in place, as `_compile_templates_once` is (an evaluation in another thread never
    restores it under this one); the originals are kept as `.original`."""
    from lm_eval import evaluator

    if getattr(evaluator.add_env_info, "plab_skipped", False):
        return

    def get_git_commit_hash():
        return None

    def add_env_info(storage: dict) -> None:
        return None

    for fn, original in ((get_git_commit_hash, evaluator.get_git_commit_hash),
                         (add_env_info, evaluator.add_env_info)):
        fn.plab_skipped = True
        fn.original = original
        setattr(evaluator, fn.__name__, fn)
