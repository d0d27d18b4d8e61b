"""The shipped plab_* tasks: data loading, rendering, and an evaluation of a real tiny checkpoint."""

from __future__ import annotations

import bz2
import gzip
import json
import math
import os
import re
from pathlib import Path

import pytest
import yaml

from training.evaluation import SHIPPED_TASKS, EvaluationError, evaluate_checkpoint, list_tasks, render_task_dirs
from training.evaluation.stats import paired_difference

DATA_DIR = Path(os.environ["PLAB_DATA_DIR"])  # tests/conftest.py sets a default

BLIMP_PARADIGMS = sorted(p.name[: -len(".jsonl.gz")] for p in (DATA_DIR / "blimp").glob("*.jsonl.gz"))


def _load_task_module(name):
    import importlib.util

    from training.evaluation import SHIPPED_TASKS_DIR

    spec = importlib.util.spec_from_file_location(f"plab_task_{name}", SHIPPED_TASKS_DIR / name / "utils.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------- task data


def test_listing_has_every_shipped_task_and_all_67_blimp_paradigms():
    tasks = {t["name"]: t for t in list_tasks()}
    assert set(SHIPPED_TASKS) <= set(tasks)
    assert len(BLIMP_PARADIGMS) == 67
    assert tasks["plab_blimp"]["kind"] == "group"
    assert sorted(tasks["plab_blimp"]["subtasks"]) == [f"plab_blimp_{p}" for p in BLIMP_PARADIGMS]
    assert tasks["plab_lambada_openai"]["output_type"] == "loglikelihood"
    assert tasks["plab_heldout_bpb"]["output_type"] == "loglikelihood_rolling"
    assert all(t["source"] == "shipped" for t in tasks.values())


def test_rendered_tasks_point_at_existing_data_files_and_leave_no_placeholder(tmp_path):
    rendered = render_task_dirs(tmp_path / "tasks", data_dir=DATA_DIR)
    assert rendered.unresolved == {}
    referenced = []
    for path in rendered.include_paths[0].rglob("*yaml"):
        text = path.read_text()
        assert "${" not in text, path
        cfg = yaml.load(text.replace("!function", ""), Loader=yaml.SafeLoader)
        kwargs = cfg.get("dataset_kwargs") or {}
        files = list((kwargs.get("data_files") or {}).values())
        files += [v for k, v in kwargs.items() if k.endswith("_file")]
        referenced += files
    assert len(referenced) == 67 + 2 + 1 + 1 + 1 + 1 + 1  # blimp, piqa (2), lambada, arc, sciq, hellaswag, heldout
    for file in referenced:
        assert os.path.isabs(file) and os.path.isfile(file), file


def test_piqa_loader_joins_questions_with_their_labels():
    piqa = _load_task_module("piqa")
    docs = piqa.load_piqa(DATA_DIR / "piqa" / "valid.jsonl", DATA_DIR / "piqa" / "valid-labels.lst")["validation"]
    labels = (DATA_DIR / "piqa" / "valid-labels.lst").read_text().split()
    first = json.loads((DATA_DIR / "piqa" / "valid.jsonl").open().readline())
    assert len(docs) == 1838
    assert docs[0]["goal"] == first["goal"] and docs[0]["sol2"] == first["sol2"]
    assert [d["label"] for d in docs] == [int(x) for x in labels]


def test_piqa_loader_refuses_misaligned_files(tmp_path):
    piqa = _load_task_module("piqa")
    labels = tmp_path / "labels.lst"
    labels.write_text("0\n1\n")
    with pytest.raises(ValueError, match="do not align"):
        piqa.load_piqa(DATA_DIR / "piqa" / "valid.jsonl", labels)


def test_hellaswag_loader_reads_all_10042_items_with_four_endings():
    hellaswag = _load_task_module("hellaswag")
    docs = hellaswag.load_hellaswag_text(DATA_DIR / "hellaswag" / "hellaswag_val_full.txt.bz2")["validation"]
    lines = bz2.open(DATA_DIR / "hellaswag" / "hellaswag_val_full.txt.bz2", "rt").read().split("\n")
    assert len(docs) == 10042
    assert all(len(d["choices"]) == 4 and 0 <= d["label"] <= 3 for d in docs)
    last = docs[-1]
    assert [last["query"], str(last["label"]), *last["choices"]] == lines[-7:-1]
    # lm-eval's own preprocessing of the query and every ending (WikiHow's [markup], double spaces): 14 items change
    from lm_eval.tasks.hellaswag.utils import preprocess

    raw = lines[:-1]
    items = [raw[i:i + 6] for i in range(0, len(raw), 6)]
    assert [[d["query"], *d["choices"]] for d in docs] == [[preprocess(t) for t in (it[0], *it[2:])] for it in items]
    assert sum([d["query"], *d["choices"]] != [it[0], *it[2:]] for d, it in zip(docs, items)) == 14


def test_heldout_documents_concatenate_back_to_the_normalised_text():
    import datasets

    heldout = _load_task_module("heldout")
    raw = "\ufeffline one\r\nline two\r\n" + "x" * 5000 + "\r\nlast line\r\n"
    docs = heldout.split_into_documents(datasets.Dataset.from_dict({"text": [raw]}))["text"]
    assert "".join(docs) == raw.replace("\ufeff", "").replace("\r\n", "\n")
    assert len(docs) == 2 and all(len(d) >= 1 for d in docs)


# ----------------------------------------------------------------------------- evaluation


def test_every_shipped_task_gives_finite_metrics_stderrs_hashes_and_timing(shipped_results):
    r = shipped_results
    limit = r["limit"]
    assert r["lm_eval_version"] == "0.4.13"
    assert r["device"] == "cpu" and r["dtype"] == "float32" and isinstance(limit, int)
    for name in SHIPPED_TASKS:
        task = r["tasks"][name]
        assert task["metrics"], name
        for metric, m in task["metrics"].items():
            assert m["value"] is not None and math.isfinite(m["value"]), (name, metric)
        assert task["time_s"] > 0
        assert re.fullmatch(r"[0-9a-f]{64}", task["task_hash"]) and re.fullmatch(r"[0-9a-f]{64}", task["config_digest"])
        expected_n = 67 * limit if name == "plab_blimp" else limit
        assert task["n_samples"] == expected_n, name
    for name in ("plab_piqa", "plab_sciq", "plab_arc_easy", "plab_hellaswag"):
        assert set(r["tasks"][name]["metrics"]) == {"acc", "acc_norm"}
    # Accuracies have lm-eval's closed-form stderr; bits_per_byte has none in lm-eval.
    assert r["tasks"]["plab_piqa"]["metrics"]["acc"]["stderr"] is not None
    assert set(r["tasks"]["plab_lambada_openai"]["metrics"]) == {"acc", "perplexity"}
    assert r["tasks"]["plab_lambada_openai"]["metrics"]["perplexity"]["value"] > 1
    bpb = r["tasks"]["plab_heldout_bpb"]["metrics"]["bits_per_byte"]
    assert 0 < bpb["value"] < 16 and bpb["stderr"] is None
    assert r["tasks"]["plab_heldout_bpb"]["n_docs"] > 200  # Tiny Shakespeare in ~4 KiB documents


def test_blimp_group_score_is_the_mean_over_the_67_paradigms(shipped_results):
    tasks = shipped_results["tasks"]
    group = tasks["plab_blimp"]
    assert group["kind"] == "group" and len(group["subtasks"]) == 67
    paradigm_accs = [tasks[s]["metrics"]["acc"]["value"] for s in group["subtasks"]]
    assert group["metrics"]["acc"]["value"] == pytest.approx(sum(paradigm_accs) / 67)
    assert all(tasks[s]["group"] == "plab_blimp" and tasks[s]["time_s"] is None for s in group["subtasks"])


def test_per_sample_scores_reproduce_every_task_metric(shipped_results):
    """The compact per-sample record is what paired tests run on: it must aggregate back
    to lm-eval's own number for every metric."""
    for name, task in shipped_results["tasks"].items():
        if task["kind"] != "task":
            continue
        assert task["samples"]["doc_id"] == list(range(task["n_samples"])), name
        for metric, agg in task["aggregation"].items():
            values = task["samples"][metric]
            if agg == "mean" and metric.startswith("acc"):
                assert set(values) <= {0.0, 1.0}, (name, metric)
            same = paired_difference(values, values, statistic=agg, n_boot=100)
            assert same["baseline"] == pytest.approx(task["metrics"][metric]["value"], rel=1e-9), (name, metric)


def test_blimp_accuracy_is_log_p_good_above_log_p_bad_under_the_checkpoint(tiny_checkpoint, shipped_results):
    """Recompute one paradigm by hand with transformers: the sentence scored after the
    end-of-text token, correct when the good sentence is more likely."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)

    def logprob(sentence):
        ids = [tok.eos_token_id] + tok(" " + sentence, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits.log_softmax(-1)[0]
        return sum(logits[i, ids[i + 1]].item() for i in range(len(ids) - 1))

    paradigm = "anaphor_number_agreement"
    with gzip.open(DATA_DIR / "blimp" / f"{paradigm}.jsonl.gz", "rt") as fh:
        pairs = [json.loads(next(fh)) for _ in range(shipped_results["limit"])]
    expected = [float(logprob(p["sentence_good"]) > logprob(p["sentence_bad"])) for p in pairs]
    assert shipped_results["tasks"][f"plab_blimp_{paradigm}"]["samples"]["acc"] == expected


# ----------------------------------------------------------------------------- input validation


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tasks": ["plab_piqaa"]}, "did you mean plab_piqa"),
        ({"tasks": []}, "non-empty task names"),
        ({"tasks": ["plab_piqa", "plab_piqa"]}, "repeated"),
        ({"limit": 0}, "limit must be a whole number of documents per task"),
        ({"limit": -0.5}, "limit must be a whole number of documents per task"),
        ({"limit": 1.5}, r"or a fraction of each task's documents between 0 and 1 .*, got 1\.5"),
        ({"limit": True}, "limit must be a whole number of documents per task"),
        ({"device": "tpu"}, "device must be"),
        ({"batch_size": 0}, "batch_size must be"),
        ({"dtype": "int8"}, "dtype must be one of"),
    ],
)
def test_bad_arguments_are_refused_with_a_fix(tiny_checkpoint, kwargs, message):
    kwargs = {"tasks": ["plab_piqa"], **kwargs}
    with pytest.raises(EvaluationError, match=message):
        evaluate_checkpoint(tiny_checkpoint, **kwargs)


def test_a_directory_that_is_not_a_checkpoint_is_refused(tmp_path, tiny_checkpoint):
    with pytest.raises(EvaluationError, match="does not exist"):
        evaluate_checkpoint(tmp_path / "missing", ["plab_piqa"])
    with pytest.raises(EvaluationError, match="no config.json"):
        evaluate_checkpoint(tmp_path, ["plab_piqa"])
    (tmp_path / "config.json").write_text((tiny_checkpoint / "config.json").read_text())
    with pytest.raises(EvaluationError, match="no tokenizer files"):
        evaluate_checkpoint(tmp_path, ["plab_piqa"])


def test_a_missing_heldout_text_is_reported_before_loading_the_model(tiny_checkpoint, tmp_path):
    with pytest.raises(EvaluationError, match="held-out text .* is not a file"):
        evaluate_checkpoint(tiny_checkpoint, ["plab_heldout_bpb"], heldout_text=tmp_path / "nope.txt")


def _evaluate_in_daemon(checkpoint, limit, queue):
    try:
        result = evaluate_checkpoint(checkpoint, ["plab_lambada_openai"], limit=limit, device="cpu", batch_size=32)
        queue.put(result["tasks"]["plab_lambada_openai"]["metrics"])
    except Exception as err:  # noqa: BLE001 - the parent reports it
        queue.put(repr(err))


def test_evaluation_runs_inside_a_daemonic_worker_process_with_the_same_stderr(tiny_checkpoint, shipped_results):
    """Celery's prefork workers are daemonic and may not start the process pool lm-eval
    uses for bootstrap stderrs (LAMBADA perplexity); the adapter runs it in-process."""
    import multiprocessing

    # spawn, not fork: a forked child of a process that already ran torch can deadlock in
    # its OpenMP thread pool.
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    worker = ctx.Process(target=_evaluate_in_daemon, args=(tiny_checkpoint, shipped_results["limit"], queue), daemon=True)
    worker.start()
    metrics = queue.get(timeout=240)
    worker.join(timeout=60)
    assert isinstance(metrics, dict), metrics
    assert metrics == shipped_results["tasks"]["plab_lambada_openai"]["metrics"]


@pytest.mark.slow
def test_standard_lm_eval_task_names_pass_through_to_lm_eval(tiny_checkpoint):
    """`arc_easy` is lm-eval's own task (dataset allenai/ai2_arc on the Hub): it is found in
    lm-eval's registry; it runs when the dataset is in the HF cache, and otherwise (offline)
    the error says what to do."""
    try:
        result = evaluate_checkpoint(tiny_checkpoint, ["arc_easy"], limit=2, device="cpu")
    except EvaluationError as err:
        assert re.search(r"'arc_easy' needs its dataset .*ai2_arc.*--online", str(err)), err
    else:
        assert result["tasks"]["arc_easy"]["n_samples"] == 2
        assert set(result["tasks"]["arc_easy"]["metrics"]) == {"acc", "acc_norm"}


def test_the_data_directory_defaults_like_every_other_command_and_a_wrong_one_is_named(monkeypatch, tmp_path):
    """`plab eval` without PLAB_DATA_DIR used to stop ('PLAB_DATA_DIR ... is not set') where `plab train` found
    the data beside the checkout; --data-dir's mistake was reported as PLAB_DATA_DIR's."""
    from training.config import default_data_dir
    from training.evaluation.taskdirs import TaskConfigError, resolve_data_dir

    monkeypatch.delenv("PLAB_DATA_DIR", raising=False)
    assert resolve_data_dir() == default_data_dir().resolve()
    with pytest.raises(TaskConfigError, match=r"^--data-dir '/no/such/dir' is not a directory"):
        resolve_data_dir("/no/such/dir")
    monkeypatch.setenv("PLAB_DATA_DIR", str(tmp_path / "missing"))
    with pytest.raises(TaskConfigError, match=r"^PLAB_DATA_DIR='.*missing' is not a directory"):
        resolve_data_dir()


def test_the_default_heldout_text_is_said_not_to_be_held_out(tiny_checkpoint, monkeypatch, capsys):
    """By hand without --heldout-text, plab_heldout_bpb scores a whole corpus file (the worker passes the run's own
    validation split): the command says that most of it is training text for a run trained on it."""
    from training.evaluation import evaluate_checkpoint

    monkeypatch.delenv("PLAB_EVAL_HELDOUT_TEXT", raising=False)
    evaluate_checkpoint(tiny_checkpoint, ["plab_heldout_bpb"], limit=1, device="cpu")
    err = capsys.readouterr().err
    assert "plab_heldout_bpb scores tinyshakespeare/input.txt whole (no --heldout-text)" in err
    assert "not held out" in err


def test_perplexity_tasks_are_windowed_at_the_trained_context_and_multiple_choice_is_not(tiny_checkpoint, tmp_path):
    """A checkpoint that records the context it was trained on (training.model.TRAINED_CONTEXT_ATTR, 32 here)
    has its held-out text scored in windows of that length - exactly lm-eval's own scoring of a model whose
    max_length is 32 - while PIQA's contexts keep lm-eval's max_length (256, the config's positions)."""
    import shutil

    from training.model import TRAINED_CONTEXT_ATTR

    def copy(name, **config):
        dest = tmp_path / name
        shutil.copytree(tiny_checkpoint, dest)
        data = json.loads((dest / "config.json").read_text())
        (dest / "config.json").write_text(json.dumps({**data, **config}))
        return dest

    heldout = tmp_path / "heldout.txt"
    heldout.write_text((DATA_DIR / "tinyshakespeare" / "input.txt").read_text()[-6000:])
    kw = dict(limit=4, device="cpu", batch_size=8, heldout_text=heldout, bootstrap_iters=0)
    trained = evaluate_checkpoint(copy("trained", **{TRAINED_CONTEXT_ATTR: 32}), ["plab_heldout_bpb", "plab_piqa"], **kw)
    short = evaluate_checkpoint(copy("short", max_position_embeddings=32), ["plab_heldout_bpb"], **kw)
    plain = evaluate_checkpoint(tiny_checkpoint, ["plab_heldout_bpb", "plab_piqa"], **kw)

    def bpb(r):
        return r["tasks"]["plab_heldout_bpb"]["metrics"]["bits_per_byte"]["value"]

    assert bpb(trained) == bpb(short) != bpb(plain)
    assert trained["tasks"]["plab_heldout_bpb"]["eval_settings"]["rolling_context"] == 32
    assert plain["tasks"]["plab_heldout_bpb"]["eval_settings"]["rolling_context"] == 256
    assert trained["tasks"]["plab_piqa"]["samples"] == plain["tasks"]["plab_piqa"]["samples"]
    assert "rolling_context" not in trained["tasks"]["plab_piqa"]["eval_settings"]  # scored at max_length, not windowed
    # a checkpoint written before it recorded its context: the caller says it (the worker: the run's data.seq_len)
    told = evaluate_checkpoint(tiny_checkpoint, ["plab_heldout_bpb"], rolling_context=32, **kw)
    assert bpb(told) == bpb(trained) and told["tasks"]["plab_heldout_bpb"]["eval_settings"]["rolling_context"] == 32
    with pytest.raises(EvaluationError, match="rolling_context must be a whole number of tokens >= 2"):
        evaluate_checkpoint(tiny_checkpoint, ["plab_heldout_bpb"], rolling_context=1, **kw)


def test_the_worker_takes_the_trained_context_from_the_runs_spec():
    from training.evaluation.heldout import trained_context

    assert trained_context({"model": "tiny", "data": {"seq_len": 96}}) == 96
    assert trained_context({"model": {"init_from": "models/x"}, "data": {"seq_len": 96}}) is None  # the checkpoint's
    assert trained_context({"external": True, "recipe": "bf16"}) is None
