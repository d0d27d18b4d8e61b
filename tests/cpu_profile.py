"""CPU time per test, for finding what makes the suite slow on a 2-core machine: `bash scripts/test.sh -p
tests.cpu_profile` (PLAB_CPU_PROFILE names the JSON-lines file, default ./cpu_profile.jsonl).

Wall times under pytest-xdist mostly measure the other workers (four workers on two cores run each test at a half to
a quarter of its speed), so each line holds the test's own CPU seconds (`self`: the worker process) and those of the
processes it started and waited for (`children`: a served stack's API and Celery worker, training subprocesses, gloo
ranks, Triton-interpreter subprocesses), with the wall time, start time and xdist worker beside them. Daemons a test
leaves running (Slurm's) are not counted. Summing by file, and when each worker ran out of tests (the suite's tail):
`python -m tests.cpu_profile cpu_profile.jsonl`."""
from __future__ import annotations

import collections
import json
import os
import resource
import sys
import time

import pytest

OUT_ENV = "PLAB_CPU_PROFILE"


def _cpu() -> tuple[float, float]:
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime, c.ru_utime + c.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    (s0, c0), t0 = _cpu(), time.time()
    yield
    s1, c1 = _cpu()
    line = {"id": item.nodeid, "self": round(s1 - s0, 3), "children": round(c1 - c0, 3),
            "wall": round(time.time() - t0, 3), "start": round(t0, 3),
            "worker": os.environ.get("PYTEST_XDIST_WORKER", "main")}
    with open(os.environ.get(OUT_ENV, "cpu_profile.jsonl"), "a") as f:  # one line per write: workers append safely
        f.write(json.dumps(line) + "\n")


def summary(path: str, top: int = 40) -> str:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    by_file: collections.Counter = collections.Counter()
    for r in rows:
        by_file[r["id"].split("::")[0]] += r["self"] + r["children"]
    total = sum(by_file.values())
    lines = [f"{len(rows)} tests, {total:,.0f} CPU s ({total / 2:,.0f} s on two cores at best)"]
    lines += [f"{v:8.1f}  {f}" for f, v in by_file.most_common(top)]
    if all("start" in r for r in rows):  # when each worker ran out of tests: the suite's tail
        t0 = min(r["start"] for r in rows)
        ends = collections.defaultdict(float)
        for r in rows:
            ends[r["worker"]] = max(ends[r["worker"]], r["start"] + r["wall"] - t0)
        lines.append("last test ended, by worker: " + ", ".join(f"{w} {t:,.0f} s" for w, t in sorted(ends.items())))
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(sys.argv[1] if len(sys.argv) > 1 else "cpu_profile.jsonl"))
