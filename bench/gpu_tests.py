"""Every GPU test in one pytest process on a GPU machine, with a result file like the benchmarks'.

The GPU-only tests (`tests/**/test_*_gpu.py` and `tests/precision/test_recipes.py`, which runs the real FP8 kernels
where a GPU has them) skip on the CI machine, so a GPU call is the only place they run. Run one file at a time, they
miss what one run leaves to the next in the same process: on 2026-11-28, all of them in one process on an H200 found
a workspace and a process group that outlived their runs (bench/NOTES_floor.md 77). This runs them all in one
process, records each test's outcome and time, the failures' first error lines, the device, torch's and torchao's
versions and the commit, prints the failures last, and writes bench/results/gpu_tests_<device>_<time>.json (and
$OUT/gpu_tests.json on the GPU machine). It exits with pytest's status.

    python bench/gpu_tests.py [--budget-s 560] [--paths FILE|'PATTERN'|TEST_ID ...] [-- PYTEST_ARGS ...]

Within --budget-s the run is stopped and what finished is recorded, so a call that runs out of time still says
which tests passed, how long each took, and which test was running when it stopped (and for how long). A test that
runs longer than --hang-dump-s has every thread's stack written to the log (pytest's faulthandler_timeout), kept in
the result as `hang_dumps`: what a hung test was waiting for.
"""
from __future__ import annotations

import argparse
import datetime as dt
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.benchmeta import REPO, git_commit, write_result  # noqa: E402

DEFAULT_PATHS = ("tests/training/*_gpu.py", "tests/precision/*_gpu.py", "tests/precision/test_recipes.py")
# pytest -v: "tests/x.py::test_name[param] PASSED                [ 12%]"
_LINE = re.compile(r"^(\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


PROGRESS_ENV = "PLAB_GPU_TESTS_PROGRESS"  # where the pytest process writes one JSON line per test event
_running: dict[str, dict] = {}


def pytest_runtest_logstart(nodeid, location):  # noqa: ARG001 - pytest hook (this module is loaded with -p)
    _running[nodeid] = {"s": 0.0, "outcome": "passed"}
    _progress({"event": "start", "test": nodeid, "t": time.time()})


def pytest_runtest_logreport(report):  # pytest hook: setup, call and teardown each report here
    row = _running.setdefault(report.nodeid, {"s": 0.0, "outcome": "passed"})
    row["s"] += report.duration
    if report.failed:
        row["outcome"] = "failed" if report.when == "call" else "error"
        row.setdefault("message", first_error_line(str(report.longrepr)))
    elif report.skipped and row["outcome"] == "passed":
        row["outcome"] = "xfailed" if hasattr(report, "wasxfail") else "skipped"
    elif report.when == "call" and hasattr(report, "wasxfail"):  # an xfail test that passed
        row["outcome"] = "xpassed"


def pytest_runtest_logfinish(nodeid, location):  # noqa: ARG001 - pytest hook
    row = _running.pop(nodeid, {"s": 0.0, "outcome": "passed"})
    _progress({"event": "done", "test": nodeid, **row, "s": round(row["s"], 1), "t": time.time()})


def _progress(event: dict) -> None:
    path = os.environ.get(PROGRESS_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(event) + "\n")


def from_progress(path: Path, now: float | None = None) -> tuple[list[dict], dict | None]:
    """The tests that finished (test id, outcome, seconds, a failure's first error line), and the one that had
    started and not finished, with how long it had run, from the lines the pytest process wrote."""
    rows, started = [], {}
    for line in path.read_text().splitlines():
        event = json.loads(line)
        if event["event"] == "start":
            started[event["test"]] = event["t"]
        else:
            started.pop(event["test"], None)
            rows.append({k: v for k, v in event.items() if k not in ("event", "t")})
    running = None
    if started:
        test, t0 = max(started.items(), key=lambda kv: kv[1])
        running = {"test": test, "s": round((now if now is not None else time.time()) - t0, 1)}
    return rows, running


def hang_dumps(log: str, limit: int = 12000) -> str | None:
    """faulthandler's stacks of a test that ran past faulthandler_timeout ("Timeout (0:02:30)!" and the threads)."""
    i = log.find("Timeout (")
    return log[i:i + limit] if i >= 0 else None


def default_paths() -> list[str]:
    return expand_paths(list(DEFAULT_PATHS))[0]


def expand_paths(given: list[str]) -> tuple[list[str], list[str]]:
    """`--paths` as pytest needs them: a pattern (`tests/training/*_gpu.py`, quoted so the shell passed it as is) is
    expanded here, relative to the repository like pytest's paths, in sorted order; a test id (`FILE::name`) or a
    plain path is kept. Returns (paths, the entries that name no file)."""
    paths, missing = [], []
    for entry in given:
        file = REPO / entry.split("::", 1)[0]  # an absolute path stays itself
        if glob.has_magic(str(file)):
            found = sorted(glob.glob(str(file)))
            if not found:
                missing.append(entry)
            paths.extend(str(Path(f).relative_to(REPO)) if Path(f).is_relative_to(REPO) else f for f in found)
        elif not file.exists():
            missing.append(entry)
        else:
            paths.append(entry)
    return paths, missing


def from_junit(path: Path) -> list[dict]:
    """One row per test case of pytest's JUnit XML: test id, outcome, seconds, and a failure's first error line."""
    rows = []
    for case in ET.parse(path).iter("testcase"):
        outcome, message = "passed", None
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                message = first_error_line(child.get("message") or child.text or "")
        module = case.get("classname", "")
        file = module.replace(".", "/") + ".py" if module else ""
        rows.append({"test": f"{file}::{case.get('name')}", "outcome": outcome,
                     "s": round(float(case.get("time") or 0.0), 1), **({"message": message} if message else {})})
    return rows


def from_log(text: str) -> list[dict]:
    """The tests pytest -v reported before it stopped (no JUnit file when the budget ran out)."""
    names = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped", "XFAIL": "xfailed",
             "XPASS": "xpassed"}
    rows = []
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if m:
            rows.append({"test": m.group(1), "outcome": names[m.group(2)]})
    return rows


def first_error_line(text: str) -> str:
    """The line that says what went wrong: the first `E   ...` line of a traceback, else the text's first line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith("E "):
            return ln[1:].strip()[:400]
    return (lines[0] if lines else "")[:400]


def device_and_versions() -> dict:
    info = {"device": "cpu", "torch": None, "torchao": None}
    try:
        import torch
        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["device"] = torch.cuda.get_device_name(0)
            info["gpus"] = torch.cuda.device_count()
    except Exception as e:  # noqa: BLE001 - recorded, not fatal: pytest will say more
        info["torch"] = f"not importable: {e}"
    try:
        import torchao
        info["torchao"] = torchao.__version__
    except Exception:  # noqa: BLE001
        pass
    return info


def run(paths: list[str], budget_s: float, extra: list[str], results_dir: Path | None = None,
        hang_dump_s: float = 240.0, blockwise_autotune: str = "quick") -> tuple[dict, int]:
    with tempfile.TemporaryDirectory() as tmp:
        junit, progress = Path(tmp) / "junit.xml", Path(tmp) / "progress.jsonl"
        cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "bench.gpu_tests", "-rfEs",
               f"--junitxml={junit}", "-o", f"faulthandler_timeout={hang_dump_s:g}", *paths, *extra]
        start = time.monotonic()
        timed_out = False
        try:
            proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  timeout=budget_s, env={**os.environ, "PYTHONUNBUFFERED": "1",  # the log up to a
                                                         PROGRESS_ENV: str(progress),  # stop is kept
                                                         "PLAB_BLOCKWISE_AUTOTUNE": blockwise_autotune})
            log, rc = proc.stdout, proc.returncode
        except subprocess.TimeoutExpired as e:
            timed_out, rc = True, 124
            log = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        wall = time.monotonic() - start
        running = None
        if progress.exists():
            rows, running = from_progress(progress)
        else:
            rows = from_junit(junit) if junit.exists() else from_log(log)
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["outcome"]] = counts.get(row["outcome"], 0) + 1
    info = device_and_versions()
    summary = {
        "bench": "gpu_tests",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        **info,
        "git_commit": git_commit(),
        "command": " ".join(["python bench/gpu_tests.py", *paths]),
        "blockwise_autotune": blockwise_autotune,
        "pytest_exit": rc,
        "timed_out": timed_out,
        "wall_s": round(wall, 1),
        "counts": counts,
        "failures": [r for r in rows if r["outcome"] in ("failed", "error")],
        "running_when_stopped": running if timed_out else None,
        "hang_dumps": hang_dumps(log),
        "tests": rows,
        "log_tail": log[-4000:],
    }
    write_result(summary, "gpu_tests", info["device"], results_dir)
    return summary, rc


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    ap = argparse.ArgumentParser(description="Every GPU test in one pytest process, with a result file.")
    ap.add_argument("--paths", nargs="+", default=None,
                    help=f"test files, quoted patterns ('tests/precision/*_gpu.py', expanded relative to the "
                         f"repository) or test ids (default: {' '.join(DEFAULT_PATHS)})")
    ap.add_argument("--budget-s", type=float, default=560.0,
                    help="stop pytest after this many seconds and record what finished (default 560)")
    ap.add_argument("--results-dir", type=Path, default=None,
                    help="write the result file here instead of bench/results (and $OUT)")
    ap.add_argument("--blockwise-autotune", choices=["quick", "full"], default="quick",
                    help="fp8_blockwise: torchao's quantizers autotune over 8 of their 45 configs (quick) or all "
                         "(full: minutes more in every fp8_blockwise test's first step; 2026-11-28 an H200 spent "
                         "over 60 s in one); PLAB_BLOCKWISE_AUTOTUNE, recorded in the result")
    ap.add_argument("--hang-dump-s", type=float, default=240.0,
                    help="write every thread's stack to the log when one test runs longer than this (default 240)")
    a = ap.parse_args(argv)
    if a.budget_s <= 0:
        ap.error(f"--budget-s must be positive, got {a.budget_s}")
    if a.hang_dump_s <= 0:
        ap.error(f"--hang-dump-s must be positive, got {a.hang_dump_s}")
    paths, missing = expand_paths(a.paths) if a.paths else (default_paths(), [])
    if missing:
        ap.error(f"--paths: {', '.join(repr(m) for m in missing)} names no file under {REPO} "
                 f"(paths are relative to the repository, e.g. 'tests/training/*_gpu.py')")
    summary, rc = run(paths, a.budget_s, extra, a.results_dir, a.hang_dump_s, a.blockwise_autotune)
    print(f"\n# GPU tests on {summary['device']} at {summary['git_commit']}: "
          + ", ".join(f"{n} {k}" for k, n in sorted(summary["counts"].items()))
          + f" in {summary['wall_s']} s" + (" (stopped at the budget)" if summary["timed_out"] else ""))
    if summary["running_when_stopped"]:
        r = summary["running_when_stopped"]
        print(f"RUNNING {r['test']} for {r['s']} s when stopped" + (" (stacks in hang_dumps)" if summary["hang_dumps"]
                                                                   else ""))
    for f in summary["failures"]:
        print(f"{f['outcome'].upper():6} {f['test']}\n       {f.get('message', '')}")
    if not summary["tests"] and not summary["timed_out"]:
        # Nothing ran: pytest's own words say why (a collection error, an unknown option).
        print(f"NO TEST RAN (pytest exit {rc}); the end of its log:\n{summary['log_tail'][-1500:]}")
        return rc or 5
    return rc


if __name__ == "__main__":
    sys.exit(main())
