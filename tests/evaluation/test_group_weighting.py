"""A group's score as lm-eval reports it, and the paired comparison's group rows on the same footing.

lm-eval 0.4 scores a group over all its leaf tasks (through any subgroups) as the mean of their scores, weighted by
their document counts unless the group's `aggregate_metric_list` says `weight_by_size: false` (MMLU is weighted,
BLiMP is not). Three leaf tasks whose accuracy cannot depend on the model (both choices the same string: the
first one wins a tie, so a target of 0 is always right and 1 always wrong) and three groups over them, evaluated
with the real lm-eval on a tiny checkpoint; every group row of `compare_results` must reproduce lm-eval's number."""

from __future__ import annotations

import json

import pytest

from training.evaluation import compare_results, evaluate_checkpoint
from training.evaluation.stats import paired_difference

LEAF = """\
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: ${{TASK_DIR}}/{name}.jsonl
output_type: multiple_choice
test_split: test
doc_to_text: "The capital of {{{{country}}}} is"
doc_to_choice: "{{{{[city, city]}}}}"
doc_to_target: {target}
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""
GROUP = """\
group: {name}
task: [{tasks}]
aggregate_metric_list:
  - metric: acc
    aggregation: mean
    weight_by_size: {weighted}
metadata:
  version: 1.0
"""
LEAVES = {"geo_wrong6": (6, 1), "geo_right3": (3, 0), "geo_right2": (2, 0)}  # name: (documents, target)
GROUPS = {  # name: (children, weight_by_size, lm-eval's accuracy)
    "geo_weighted": ("geo_wrong6, geo_right2", "true", 2 / 8),
    "geo_equal": ("geo_wrong6, geo_right2", "false", 1 / 2),
    "geo_inner": ("geo_wrong6, geo_right3", "false", 1 / 2),
    # Over its three leaves, not its two children (which would give (1/2 + 1) / 2 = 3/4).
    "geo_outer": ("geo_inner, geo_right2", "false", 2 / 3),
    "geo_outer_weighted": ("geo_inner, geo_right2", "true", 5 / 11),
}


@pytest.fixture(scope="module")
def grouped_results(tiny_checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("group-tasks")
    for name, (docs, target) in LEAVES.items():
        (folder / f"{name}.yaml").write_text(LEAF.format(name=name, target=target))
        with open(folder / f"{name}.jsonl", "w") as fh:
            for i in range(docs):
                fh.write(json.dumps({"country": f"country {i}", "city": f"city {i}"}) + "\n")
    for name, (tasks, weighted, _) in GROUPS.items():
        (folder / f"_{name}.yaml").write_text(GROUP.format(name=name, tasks=tasks, weighted=weighted))
    names = ["geo_weighted", "geo_equal", "geo_outer", "geo_outer_weighted"]
    return evaluate_checkpoint(tiny_checkpoint, names, device="cpu", tasks_dir=folder, bootstrap_iters=0)


def test_every_group_row_reproduces_lm_evals_group_score(grouped_results):
    tasks = grouped_results["tasks"]
    for name, (_, weighted, expected) in GROUPS.items():
        assert tasks[name]["metrics"]["acc"]["value"] == pytest.approx(expected), name  # lm-eval's own number
        assert tasks[name]["weight_by_size"] == {"acc": weighted == "true"}, name
    rows = {r["task"]: r for r in compare_results(grouped_results, grouped_results, n_boot=200)}
    for name, (_, _, expected) in GROUPS.items():
        assert rows[name]["baseline"] == pytest.approx(expected), name
        assert rows[name]["delta"] == 0 and not rows[name]["significant"]
    assert rows["geo_outer"]["n"] == 11


def test_a_changed_leaf_moves_a_weighted_group_by_its_share_of_the_documents(grouped_results):
    candidate = json.loads(json.dumps(grouped_results))
    two = candidate["tasks"]["geo_right2"]["samples"]
    two["acc"] = [0.0] * len(two["acc"])  # the 2-document task: 1.0 -> 0.0
    rows = {r["task"]: r for r in compare_results(grouped_results, candidate, n_boot=500)}
    assert rows["geo_weighted"]["delta"] == pytest.approx(-2 / 8)
    assert rows["geo_equal"]["delta"] == pytest.approx(-1 / 2)
    assert rows["geo_outer_weighted"]["delta"] == pytest.approx(-2 / 11)
    assert rows["geo_outer"]["delta"] == pytest.approx(-1 / 3)


def test_weighted_strata_pool_their_documents_and_allow_mcnemar():
    a = [1.0] * 10 + [0.0] * 2
    strata = ["x"] * 10 + ["y"] * 2
    d = paired_difference(a, a, strata=strata, weight_by_size=True, method="mcnemar")
    assert d["baseline"] == pytest.approx(10 / 12) and d["method"] == "mcnemar"
    b = [1.0] * 10 + [1.0] * 2
    boot = paired_difference(a, b, strata=strata, weight_by_size=True, n_boot=500)
    assert boot["delta"] == pytest.approx(2 / 12)
    assert boot["ci_low"] == pytest.approx(2 / 12) and boot["ci_high"] == pytest.approx(2 / 12)
