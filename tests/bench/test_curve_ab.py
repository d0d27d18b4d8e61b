"""bench/curve_ab.py: the window comparison on made-up curves, and a whole call on a CPU (tiny model,
tinyshakespeare): A's repeats agree to the bit there, and another recipe's curve is "outside" their spread."""
import json

import pytest

from bench import curve_ab


def test_compare_puts_b_against_the_spread_of_a_repeats():
    a1 = [3.0, 2.9, 2.8, 2.7, 2.6, 2.5]
    a2 = [3.0, 2.92, 2.8, 2.68, 2.6, 2.5]        # windows of 2: means 2.96, 2.74, 2.55 (a1: 2.95, 2.75, 2.55)
    near = [3.0, 2.905, 2.8, 2.705, 2.6, 2.5]    # off A's mean by at most the spread
    far = [3.0, 2.9, 2.9, 2.8, 2.6, 2.5]         # the second window 0.1 above
    r = curve_ab.compare([a1, a2], near, window=2)
    assert r["a_spread"] == pytest.approx([0.01, 0.01, 0.0])
    assert r["verdict"] == "within" and r["windows_b_outside"] == 0
    assert r["first_step_a_repeats_differ"] == 2 and r["first_step_b_differs_from_a1"] == 2
    r = curve_ab.compare([a1, a2], far, window=2)
    assert r["verdict"] == "outside" and r["windows_b_outside"] == 1
    assert r["b_distance_max"] == pytest.approx(0.105)  # 2.85 against A's 2.745
    # one repeat: no spread, so any difference is outside unless under the floor
    assert curve_ab.compare([a1], near, window=2)["verdict"] == "outside"
    assert curve_ab.compare([a1], near, window=2, floor=0.01)["verdict"] == "within"
    with pytest.raises(ValueError, match="fewer than one window"):
        curve_ab.compare([a1], a1, window=7)


def test_the_permutation_test_tells_a_shift_from_the_spread():
    """4 A runs and 2 B runs: 15 labellings. B's two runs shifted above every A run are the most extreme labelling
    (p = 1/15); B's runs inside A's spread are not."""
    base = [3.0, 2.9, 2.8, 2.7, 2.6, 2.5]
    a_runs = [[v + d for v in base] for d in (0.0, 0.01, -0.01, 0.005)]
    shifted = [[v + d for v in base] for d in (0.05, 0.06)]
    inside = [[v + d for v in base] for d in (0.002, -0.004)]
    r = curve_ab.compare(a_runs, shifted, window=2)
    assert r["permutation"]["labellings"] == 15 and r["permutation"]["p_value"] == pytest.approx(1 / 15)
    assert r["verdict"] == "outside" and len(r["b_runs_window_means"]) == 2
    r = curve_ab.compare(a_runs, inside, window=2)
    assert r["permutation"]["p_value"] > 0.5 and r["verdict"] == "within"
    # one A and one B run: nothing to permute
    assert curve_ab.compare(a_runs[:1], base, window=2)["permutation"] is None


def test_a_whole_call_on_a_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setenv("PLAB_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(curve_ab, "write_result", lambda out, bench, device: (
        (tmp_path / f"{bench}.json").write_text(json.dumps(out))))
    rc = curve_ab.main(["--a", "bf16", "--b", "fp8_tensorwise", "--device", "cpu", "--model", "tiny", "--steps", "6",
                        "--window", "3", "--batch", "2", "--seq", "32", "--vocab", "512", "--lr", "3e-3",
                        "--val-batches", "1"])
    assert rc == 0, capsys.readouterr().err
    out = json.loads((tmp_path / "curve_ab.json").read_text())
    c = out["comparison"]
    assert [r["run"] for r in out["runs"]] == ["a0", "a1", "b0"]
    assert all(len(r["losses"]) == 6 for r in out["runs"])
    assert out["runs"][0]["losses"] == out["runs"][1]["losses"]  # deterministic on a CPU
    assert c["a_spread_max"] == 0.0 and c["first_step_a_repeats_differ"] is None
    assert c["verdict"] == "outside" and c["first_step_b_differs_from_a1"] == 1  # another recipe: its own curve
    assert all(r["val_loss"] is not None for r in out["runs"])
    # A's two runs equal, B apart: B's own labelling is the most extreme of 3 (a0 or a1 labelled "B" is half as far)
    assert c["permutation"]["labellings"] == 3 and c["permutation"]["p_value"] == pytest.approx(1 / 3)
    printed = capsys.readouterr().out
    assert "verdict: B is outside" in printed and "p = 0.333 over 3 labellings" in printed


def test_an_unknown_recipe_is_refused_before_anything_runs(capsys):
    with pytest.raises(SystemExit) as exc:
        curve_ab.main(["--a", "fp9", "--b", "bf16", "--device", "cpu"])
    assert exc.value.code == 2
    assert "unknown recipe 'fp9'" in capsys.readouterr().err


def test_a_run_that_fails_stops_the_call_with_its_output(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PLAB_HOME", str(tmp_path / "home"))
    # a model whose heads do not divide its width: the spec is refused inside the first run
    rc = curve_ab.main(["--a", "bf16", "--b", "bf16", "--device", "cpu", "--model", "tiny:num_attention_heads=3",
                        "--steps", "2", "--window", "1", "--batch", "1", "--seq", "32", "--vocab", "512"])
    assert rc == 1
    assert "run a0 (bf16) failed" in capsys.readouterr().err
