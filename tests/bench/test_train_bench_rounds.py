"""bench/train_bench.py's driver: configs of a group are timed one at a time, in interleaved rounds (A B, B A,
...), each only while the others wait at a gate. Stand-in workers run the script's own Gate and log which
steps they ran, so the test sees the order the GPU would have seen."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

WORKER = """
import json, sys, time
sys.path.insert(0, {repo!r})
from bench.train_bench import Gate, gate_steps
name, log, warmup, steps, rounds, slow_start, fail = sys.argv[1:8]
time.sleep(float(slow_start))              # a slow compile
if fail == "1":
    sys.exit(3)
gates, total = gate_steps(int(warmup), int(steps), int(rounds))
gate = Gate({gate_dir!r}, name, gates)
for step in range(1, total + 1):
    gate()
    if step > gates[0] and step not in gates:
        with open(log, "a") as f:
            f.write(name + " " + str(step) + "\\n")
        time.sleep(0.02)
print(json.dumps({{"label": name, "steps": total}}))
"""



def start(tmp_path, gate_dir, log, specs, warmup=2, steps=4, rounds=2):
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(repo=str(REPO), gate_dir=str(gate_dir)))
    procs = []
    for slot, slow_start, fail in specs:
        cmd = [sys.executable, str(script), slot, str(log), str(warmup), str(steps), str(rounds), str(slow_start),
               "1" if fail else "0"]
        procs.append(({"slot": slot, "label": slot, "recipe": "bf16"},
                      subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    return procs


def runs_of(log: Path) -> list[tuple[str, int]]:
    """The log as runs of consecutive steps of one worker: (worker, steps in the run)."""
    out: list[tuple[str, int]] = []
    last: dict[str, int] = {}
    for line in log.read_text().splitlines():
        name, step = line.split()
        if out and out[-1][0] == name and last[name] == int(step) - 1:
            out[-1] = (name, out[-1][1] + 1)
        else:
            out.append((name, 1))
        last[name] = int(step)
    return out


def test_gate_steps_split_the_timed_steps_into_rounds(bench):
    assert bench.gate_steps(6, 10, 1) == ([7], 17)
    assert bench.gate_steps(6, 10, 2) == ([7, 13], 18)
    assert bench.gate_steps(2, 5, 2) == ([3, 7], 10)  # ceil(5 / 2) = 3 timed steps a round


def test_rounds_alternate_and_never_overlap(bench, tmp_path):
    gate_dir, log = tmp_path / "gate", tmp_path / "log"
    gate_dir.mkdir()
    # B compiles slowly: A must not start before B waits at its gate.
    procs = start(tmp_path, gate_dir, log, [("A", 0.0, False), ("B", 1.5, False)], steps=6, rounds=3)
    t0 = time.perf_counter()
    finished = bench.time_group(procs, gate_dir, 3, t0, t0 + 60)
    # Three rounds of two timed steps each (a gate step between rounds): A B, B A, A B.
    assert runs_of(log) == [("A", 2), ("B", 2), ("B", 2), ("A", 2), ("A", 2), ("B", 2)]
    assert all(finished[s]["timed_alone"] for s in "AB")
    assert finished["A"]["steps"] == 2 + 3 * 3


def test_a_worker_that_dies_is_reported_and_the_other_is_still_timed(bench, tmp_path):
    gate_dir, log = tmp_path / "gate", tmp_path / "log"
    gate_dir.mkdir()
    procs = start(tmp_path, gate_dir, log, [("A", 0.0, False), ("B", 0.2, True)], steps=4, rounds=2)
    t0 = time.perf_counter()
    finished = bench.time_group(procs, gate_dir, 2, t0, t0 + 60)
    assert "exit code 3" in finished["B"]["error"]
    assert runs_of(log) == [("A", 2), ("A", 2)] and "error" not in finished["A"]


def test_a_worker_not_at_its_gate_by_the_deadline_marks_the_other_not_timed_alone(bench, tmp_path):
    gate_dir, log = tmp_path / "gate", tmp_path / "log"
    gate_dir.mkdir()
    procs = start(tmp_path, gate_dir, log, [("A", 0.0, False), ("B", 4.0, False)], steps=2, rounds=1)
    t0 = time.perf_counter()
    finished = bench.time_group(procs, gate_dir, 1, t0, t0 + 2.0)
    assert finished["A"]["timed_alone"] is False


def test_a_worker_past_its_deadline_is_reported_with_how_long_it_ran():
    from bench.train_bench import _finish

    t0 = time.perf_counter() - 40.0  # the group started 40 s ago; 0.2 s of its deadline are left
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    res = _finish(proc, {"label": "slow", "recipe": "bf16"}, t0, 0.2)
    assert proc.poll() is not None  # killed, not left running
    assert res["error"].startswith("timed out: still building or running after 4"), res["error"]
    assert res["wall_s"] >= 40.0


SQUEEZED_WORKER = """
import json, os, sys, time
from pathlib import Path
sys.path.insert(0, {repo!r})
from bench.train_bench import Gate, gate_steps
config, gate_dir, live = json.loads(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
mine = live / config["slot"]
mine.touch()
time.sleep(0.5)                            # every worker of the group has started by now
others = len(list(live.iterdir())) - 1
gates, total = gate_steps(1, 2, 1)
gate = Gate(gate_dir, config["slot"], gates)
for _ in range(total):
    gate()
mine.unlink()
# A "big" config's allocator has to free cached memory while other processes hold theirs.
retries = others if config["label"].startswith("big") else 0
print(json.dumps({{"label": config["label"], "recipe": config["recipe"], "tokens_per_s": 1000.0 / (1 + retries),
                  "step_time_s": 0.1 * (1 + retries), "allocator": {{"alloc_retries": retries}}}}))
"""


def squeezed_workers(bench, tmp_path, monkeypatch):
    """run_configs' workers replaced by SQUEEZED_WORKER; returns the driver's arguments (2 configs at a time)."""
    import argparse

    script, live = tmp_path / "worker.py", tmp_path / "live"
    script.write_text(SQUEEZED_WORKER.format(repo=str(REPO)))
    live.mkdir()
    monkeypatch.setattr(bench, "_worker_cmd", lambda config, a, scratch, api_url, gate_dir:
                        [sys.executable, str(script), bench.json.dumps(config), str(gate_dir), str(live)])
    return argparse.Namespace(concurrency=2, rounds=1, per_run_timeout_s=60.0)


def test_a_config_squeezed_by_its_group_is_timed_again_alone(bench, tmp_path, monkeypatch):
    a = squeezed_workers(bench, tmp_path, monkeypatch)
    configs = [{"label": n, "recipe": "bf16"} for n in ("small", "big", "small2")]
    results = bench.run_configs(configs, a, tmp_path, lambda: 1000.0, None)
    assert [r["label"] for r in results] == ["small", "big", "small2"]  # the configs' order
    small, big, small2 = results
    assert "retimed_alone" not in small and "retimed_alone" not in small2
    assert big["allocator"]["alloc_retries"] == 0 and big["step_time_s"] == pytest.approx(0.1)
    assert big["retimed_alone"].startswith("1 allocator retries")
    assert big["in_group"]["allocator"]["alloc_retries"] == 1 and big["in_group"]["group"] == 1
    assert [small["group"], big["group"], small2["group"]] == [1, 2, 3]


def test_a_squeezed_config_keeps_its_group_result_when_the_budget_is_spent(bench, tmp_path, monkeypatch):
    a = squeezed_workers(bench, tmp_path, monkeypatch)
    left = iter([1000.0, 1000.0])  # enough for the first group only
    results = bench.run_configs([{"label": n, "recipe": "bf16"} for n in ("small", "big")], a, tmp_path,
                                lambda: next(left, 0.0), None)
    big = results[1]
    assert big["allocator"]["alloc_retries"] == 1 and "retimed_alone" not in big
    assert big["not_retimed_alone"].startswith("1 allocator retries") and "budget" in big["not_retimed_alone"]


def test_the_profiler_window_is_synchronized_at_its_edges_only(bench):
    """--profile: the profiler steps once per logged step; the device is synchronized when the active window opens
    (call wait + 1) and closes (call wait + 1 + active), so the window holds only work launched inside it."""
    events = []

    class Prof:
        def step(self):
            events.append("step")

    step = bench.profiler_stepper(Prof(), wait=3, active=3, sync=lambda: events.append("sync"))
    for _ in range(9):
        step()
    assert events == ["step"] * 3 + ["sync", "step"] + ["step"] * 2 + ["sync", "step"] + ["step"] * 2
    no_gpu = bench.profiler_stepper(Prof(), wait=3, active=3, sync=None)
    events.clear()
    for _ in range(9):
        no_gpu()
    assert events == ["step"] * 9
