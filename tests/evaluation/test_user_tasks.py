"""A user adds a task by dropping a YAML and its data into PLAB_EVAL_TASKS_DIR: no code change."""

from __future__ import annotations

import json
import math

import pytest

from tests.user_task import CAPITALS, USER_TASK_YAML, write_user_task
from training.evaluation import EvaluationError, evaluate_checkpoint, list_tasks, main


@pytest.fixture
def user_tasks_dir(tmp_path, monkeypatch):
    tasks_dir = write_user_task(tmp_path / "my-tasks")
    monkeypatch.setenv("PLAB_EVAL_TASKS_DIR", str(tasks_dir))
    return tasks_dir


def test_a_dropped_in_task_is_listed_next_to_the_shipped_ones(user_tasks_dir, capsys):
    tasks = {t["name"]: t for t in list_tasks()}
    assert tasks["my_capitals"]["source"] == "user"
    assert tasks["my_capitals"]["output_type"] == "multiple_choice"
    assert tasks["plab_piqa"]["source"] == "shipped"

    assert main(["--list-tasks"]) == 0
    listing = capsys.readouterr().out
    assert "my_capitals" in listing and "plab_blimp" in listing
    assert "plab_blimp_wh_island" not in listing  # paradigms are summarised under their group


def test_a_dropped_in_task_runs_through_plab_eval_with_a_custom_heldout_text(
    user_tasks_dir, tiny_checkpoint, tmp_path, capsys
):
    heldout = tmp_path / "validation.txt"
    heldout.write_text("It was the best of times, it was the worst of times.\n" * 300)  # 15,900 bytes
    output = tmp_path / "results.json"
    status = main([
        str(tiny_checkpoint), "--tasks", "my_capitals,plab_heldout_bpb", "--limit", "4",
        "--device", "cpu", "--heldout-text", str(heldout), "--output", str(output),
    ])
    assert status == 0
    printed = capsys.readouterr().out
    assert "my_capitals" in printed and "bits_per_byte" in printed

    result = json.loads(output.read_text())
    mine = result["tasks"]["my_capitals"]
    assert mine["n_samples"] == 4 and mine["n_docs"] == len(CAPITALS)
    assert 0.0 <= mine["metrics"]["acc"]["value"] <= 1.0
    assert mine["metrics"]["acc"]["value"] == sum(mine["samples"]["acc"]) / 4
    # each task says how it was scored: a comparison refuses two scored in different dtypes (test_stats)
    assert mine["eval_settings"] == {"dtype": "float32", "lm_eval_version": result["lm_eval_version"]}
    bpb = result["tasks"]["plab_heldout_bpb"]
    assert bpb["n_docs"] == 4  # 300 lines of 53 bytes, cut into documents of >= 4,096 characters
    assert math.isfinite(bpb["metrics"]["bits_per_byte"]["value"])
    # All 4 documents were scored, and together they are the whole file.
    assert sum(n for _, n in bpb["samples"]["bits_per_byte"]) == len(heldout.read_bytes())


def test_a_task_with_an_unset_placeholder_is_refused_before_loading_the_model(
    user_tasks_dir, tiny_checkpoint, monkeypatch
):
    monkeypatch.delenv("MY_CORPUS_DIR", raising=False)
    (user_tasks_dir / "needs_var.yaml").write_text(
        USER_TASK_YAML.replace("my_capitals", "needs_var").replace("${TASK_DIR}", "${MY_CORPUS_DIR}")
    )
    with pytest.raises(EvaluationError, match=r"needs_var.*\$\{MY_CORPUS_DIR\}.*not set"):
        evaluate_checkpoint(tiny_checkpoint, ["needs_var"])


def test_a_template_naming_a_field_its_documents_lack_is_an_error_that_names_the_task(user_tasks_dir,
                                                                                       tiny_checkpoint):
    """A typo in a user task's template ({{countryy}}) was jinja2's traceback out of `plab eval`."""
    (user_tasks_dir / "typo.yaml").write_text(
        USER_TASK_YAML.replace("task: my_capitals", "task: typo_task").replace("{{country}}", "{{countryy}}"))
    with pytest.raises(EvaluationError, match=r"task 'typo_task': its prompt template failed \(UndefinedError: "
                                              r"'countryy' is undefined\); check its YAML's doc_to_text"):
        evaluate_checkpoint(tiny_checkpoint, ["typo_task"], limit=2)


def test_a_missing_tasks_dir_is_an_error_not_an_empty_list(tmp_path, monkeypatch):
    monkeypatch.setenv("PLAB_EVAL_TASKS_DIR", str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="PLAB_EVAL_TASKS_DIR names .* not a directory"):
        list_tasks()
    assert main(["--list-tasks"]) == 2


def test_a_broken_user_yaml_is_listed_as_invalid_with_the_reason(user_tasks_dir, capsys):
    (user_tasks_dir / "broken.yaml").write_text("task: [unclosed\n")
    (user_tasks_dir / "no_task_key.yaml").write_text("dataset_path: json\n")
    invalid = {t["name"]: t for t in list_tasks() if t["kind"] == "invalid"}
    assert set(invalid) == {"broken", "no_task_key"}
    assert "Unknown config shape" in invalid["no_task_key"]["error"]
    assert main(["--list-tasks"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("broken") and "INVALID" in line for line in lines)


def test_a_fractional_limit_scores_that_share_of_each_tasks_documents(user_tasks_dir, tiny_checkpoint):
    # As lm-eval's --limit: 0.5 of the six documents is three (rounded up); what the API and `plab eval RUN --limit`
    # now accept for a worker's evaluation, which passes it here unchanged.
    result = evaluate_checkpoint(tiny_checkpoint, ["my_capitals"], limit=0.5, device="cpu")
    mine = result["tasks"]["my_capitals"]
    assert result["limit"] == 0.5 and mine["n_docs"] == len(CAPITALS) and mine["n_samples"] == 3
    assert len(mine["samples"]["acc"]) == 3
