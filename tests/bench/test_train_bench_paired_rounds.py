"""bench/train_bench.py's paired-by-round comparison: each config against the baseline in the rounds they were timed
in back to back, so the GPU's power-cap drift between rounds cancels (NOTES_floor 72: single-round calls could not
resolve a 1 ms change that 8 interleaved rounds did)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def test_the_8_round_call_pairs_into_8_rounds_all_faster_and_an_exact_p(bench):
    d = json.loads((RESULTS / "train_bench_2026-11-28T0821_NVIDIA_H200_loss_weight_grad_ab_8rounds_at_6a5546e.json")
                   .read_text())
    per_chunk, one_gemm = d["results"][1], d["results"][0]   # baseline: per_chunk; config under test: one_gemm
    p = bench.paired_by_round(per_chunk["timed_steps_s"], one_gemm["timed_steps_s"], d["rounds"])
    assert p["rounds"] == 8 and p["steps_per_round"] == 2 and p["exact"]
    assert p["faster_in"] == 8 and p["mean_diff_ms"] == pytest.approx(-1.92, abs=0.01)
    assert p["sign_flip_p"] == pytest.approx(2 / 256)   # only all-minus and all-plus are as extreme
    assert p["diff_ms"][2] == pytest.approx(-4.25, abs=0.01)


def test_the_4_round_call_does_not_resolve_it(bench):
    d = json.loads((RESULTS / "train_bench_2026-11-28T0803_NVIDIA_H200_loss_weight_grad_ab_4rounds_at_19dab1f.json")
                   .read_text())
    p = bench.paired_by_round(d["results"][1]["timed_steps_s"], d["results"][0]["timed_steps_s"], d["rounds"])
    assert p["faster_in"] == 3 and p["sign_flip_p"] == pytest.approx(0.5)


def test_equal_configs_give_p_one_and_unpairable_steps_give_none(bench):
    steps = [0.1, 0.11, 0.1, 0.12, 0.1, 0.1]
    p = bench.paired_by_round(steps, steps, 3)
    assert p["mean_diff_ms"] == 0 and p["sign_flip_p"] == 1.0 and p["faster_in"] == 0
    assert bench.paired_by_round(steps, steps, 1) is None           # one round: nothing to pair
    assert bench.paired_by_round(steps, steps[:4], 3) is None       # a config that stopped early
    assert bench.paired_by_round(steps, steps[:5] + [0.1], 4) is None  # 6 steps do not split into 4 rounds


def test_many_rounds_are_sampled_with_a_fixed_seed(bench):
    base = [0.100] * 20
    faster = [0.099] * 20
    p = bench.paired_by_round(base, faster, 20)
    assert not p["exact"] and p["faster_in"] == 20 and p["sign_flip_p"] < 1e-3
    assert bench.paired_by_round(base, faster, 20) == p


@pytest.mark.slow
def test_a_cpu_run_in_rounds_reports_the_pairing(bench, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    rc = bench.main(["--device", "cpu", "--model", "tiny", "--seq", "64", "--batch", "2", "--steps", "4",
                     "--warmup", "1", "--rounds", "2", "--no-anchor", "--no-api", "--baseline", "bf16:compile=false",
                     "--configs", "bf16:compile=false", "bf16:compile=false,loss_weight_grad=per_chunk"])
    assert rc == 0
    report = json.loads((tmp_path / "train_bench.json").read_text())
    base, other = report["results"]
    assert "vs_baseline_by_round" not in base
    paired = other["vs_baseline_by_round"]
    assert paired["baseline"] == "bf16:compile=false" and paired["rounds"] == 2 and paired["steps_per_round"] == 2
    assert len(paired["diff_ms"]) == 2 and 0 < paired["sign_flip_p"] <= 1
    assert "paired by round against bf16:compile=false" in capsys.readouterr().out
