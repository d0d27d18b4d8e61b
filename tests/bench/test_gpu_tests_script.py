"""bench/gpu_tests.py (every GPU test in one process, with a result file) on a CPU: its record of outcomes, failures'
first error lines and the run's facts, from a complete pytest run and from the lines of one stopped at its budget."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench import gpu_tests

REPO = Path(__file__).resolve().parents[2]

SAMPLE = '''
import pytest

def test_ok():
    pass

@pytest.mark.skip(reason="needs a GPU")
def test_skipped():
    pass

@pytest.mark.xfail(strict=False, reason="known")
def test_known_broken():
    assert False

@pytest.mark.xfail(strict=False, reason="known, since fixed")
def test_known_fixed():
    pass

@pytest.mark.parametrize("n", [1, 2])
def test_broken(n):
    product = 1
    assert product == n, "the product differs"
'''


def test_a_whole_run_records_every_outcome_and_each_failures_error_line(tmp_path):
    sample = tmp_path / "test_sample.py"
    sample.write_text(SAMPLE)
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_tests.py"), "--paths", str(sample),
                           "--results-dir", str(out), "--budget-s", "300"], cwd=REPO, capture_output=True,
                          text=True, timeout=400)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # pytest's status: a test failed
    [path] = list(out.glob("gpu_tests_*.json"))
    result = json.loads(path.read_text())
    assert result["bench"] == "gpu_tests" and result["device"] == "cpu" and result["git_commit"]
    assert result["torch"] and result["pytest_exit"] == 1 and result["timed_out"] is False
    assert result["blockwise_autotune"] == "quick"
    assert result["counts"] == {"passed": 2, "skipped": 1, "failed": 1, "xfailed": 1, "xpassed": 1}
    [failure] = result["failures"]
    assert failure["test"].endswith("test_sample.py::test_broken[2]")
    assert "the product differs" in failure["message"]
    # the table printed last names the failure and its error line
    tail = proc.stdout[proc.stdout.index("# GPU tests on cpu"):]
    assert "1 failed, 2 passed, 1 skipped, 1 xfailed, 1 xpassed" in tail and "test_broken[2]" in tail and "the product differs" in tail
    # each test's time, from the progress lines the pytest process wrote
    assert {r["test"].split("::")[1]: r["outcome"] for r in result["tests"]} == {
        "test_ok": "passed", "test_skipped": "skipped", "test_known_broken": "xfailed", "test_known_fixed": "xpassed",
        "test_broken[1]": "passed", "test_broken[2]": "failed"}
    assert all(isinstance(r["s"], float) for r in result["tests"]) and result["running_when_stopped"] is None


HANGS = '''
import time

def test_quick():
    pass

def test_hangs():
    time.sleep(600)

def test_never_reached():
    pass
'''


def test_a_stopped_run_keeps_each_finished_tests_time_and_names_the_one_running_with_its_stacks(tmp_path):
    sample = tmp_path / "test_hangs.py"
    sample.write_text(HANGS)
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_tests.py"), "--paths", str(sample),
                           "--results-dir", str(out), "--budget-s", "25", "--hang-dump-s", "4"], cwd=REPO,
                          capture_output=True, text=True, timeout=200)
    assert proc.returncode == 124, proc.stdout[-3000:] + proc.stderr[-3000:]
    [path] = list(out.glob("gpu_tests_*.json"))
    result = json.loads(path.read_text())
    assert result["timed_out"] is True and result["counts"] == {"passed": 1}
    [quick] = result["tests"]
    assert quick["test"].endswith("test_hangs.py::test_quick") and quick["outcome"] == "passed" and quick["s"] < 5
    running = result["running_when_stopped"]
    assert running["test"].endswith("test_hangs.py::test_hangs") and 4 < running["s"] <= 30, running
    # faulthandler's dump names the line the hung test waits on
    assert "Timeout (0:00:04)!" in result["hang_dumps"] and "test_hangs.py\", line 8 in test_hangs" in \
        result["hang_dumps"], result["hang_dumps"][:2000]
    assert "RUNNING" in proc.stdout and "test_hangs" in proc.stdout


def test_a_run_stopped_at_its_budget_keeps_the_tests_that_finished():
    log = """============================= test session starts ==============================
tests/training/test_a_gpu.py::test_one PASSED                              [ 10%]
tests/training/test_a_gpu.py::test_two[fp8_rowwise] FAILED                 [ 20%]
tests/precision/test_recipes.py::test_three SKIPPED (checks the CPU answer) [ 30%]
tests/precision/test_recipes.py::test_four """
    assert gpu_tests.from_log(log) == [
        {"test": "tests/training/test_a_gpu.py::test_one", "outcome": "passed"},
        {"test": "tests/training/test_a_gpu.py::test_two[fp8_rowwise]", "outcome": "failed"},
        {"test": "tests/precision/test_recipes.py::test_three", "outcome": "skipped"},
    ]


def test_the_error_line_is_the_tracebacks_first_e_line():
    text = "self = <x>\n\n>   return self._op(*args)\nE   RuntimeError: CUDA error: CUBLAS_STATUS_INVALID_VALUE\nE   more"
    assert gpu_tests.first_error_line(text) == "RuntimeError: CUDA error: CUBLAS_STATUS_INVALID_VALUE"
    assert gpu_tests.first_error_line("AssertionError: assert not True\nmore") == "AssertionError: assert not True"


def test_the_default_selection_is_every_gpu_test_file_and_test_recipes():
    paths = gpu_tests.default_paths()
    assert "tests/precision/test_recipes.py" in paths and "tests/training/test_cublaslt_workspace_gpu.py" in paths
    assert all(p.endswith("_gpu.py") or p == "tests/precision/test_recipes.py" for p in paths)
    assert len(paths) == len(set(paths)) >= 15


def test_paths_given_as_a_quoted_pattern_are_expanded_and_one_naming_no_file_is_refused(tmp_path):
    paths, missing = gpu_tests.expand_paths(["tests/training/*_gpu.py", "tests/precision/test_recipes.py::test_x",
                                             "tests/nowhere/*_gpu.py", "tests/no_such_file.py"])
    training = [p for p in paths if p.startswith("tests/training/")]
    assert training == sorted(training) and "tests/training/test_cublaslt_workspace_gpu.py" in training
    assert all(p.endswith("_gpu.py") for p in training) and len(training) >= 5
    assert paths[-1] == "tests/precision/test_recipes.py::test_x"  # a test id is kept as given
    assert missing == ["tests/nowhere/*_gpu.py", "tests/no_such_file.py"]
    # On 2026-12-07 a quoted pattern went to pytest as is: it found no such file and the script printed empty counts.
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_tests.py"), "--paths", "tests/nowhere/*_gpu.py",
                           "--results-dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--paths: 'tests/nowhere/*_gpu.py' names no file" in proc.stderr
    assert not list(tmp_path.glob("gpu_tests_*.json"))


def test_a_run_in_which_no_test_ran_says_so_with_pytests_words_and_fails(tmp_path):
    empty = tmp_path / "test_empty.py"
    empty.write_text("x = 1\n")
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_tests.py"), "--paths", str(empty),
                           "--results-dir", str(tmp_path / "r")], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 5, proc.stdout[-2000:]  # pytest's "no tests ran"
    assert "NO TEST RAN (pytest exit 5)" in proc.stdout and "no tests ran" in proc.stdout.split("NO TEST RAN")[1]
