"""The recipes' acceptance on CPU: the `tiny` model trained 200 steps with the same seed under every recipe through
the real train loop; each recipe's final loss is within 3% of BF16's and its first-step loss equals BF16's up
to quantization error. Each run is small (4 x 32 tokens a step) so the seven runs fit in a few minutes."""
from __future__ import annotations

import fcntl
import pickle

import pytest

from training.precision import RECIPES
from training.sink import ListSink
from training.train import train

pytestmark = pytest.mark.slow

STEPS = 200
SPEC = {
    "model": "tiny",
    "data": {"corpus": "tinyshakespeare", "vocab_size": 512, "seq_len": 32, "val_fraction": 0.05},
    "training": {"steps": STEPS, "batch_size": 4, "lr": 3e-3, "warmup_steps": 20, "val_every": STEPS,
                 "val_batches": 4, "device": "cpu"},
    "seed": 0,
}


def _train(recipe: str, cache) -> tuple:
    sink = ListSink()
    result = train({**SPEC, "recipe": recipe}, sink, cache_dir=cache)
    first = next(p["metrics"]["train/loss"] for p in sink.points if "train/loss" in p["metrics"])
    report = next(e["report"] for e in sink.events if e["kind"] == "conversion_report")
    return result, first, report


class _Runs:
    """Each recipe's run, trained once per test session, when a test first asks for it. Under pytest-xdist the
    module's tests land on both workers: the first worker to ask for a recipe trains it, under a lock on that
    recipe in the session's shared temporary folder, and the others read its result - so the two workers train
    different recipes at once instead of one training all seven while the other waits on the lock."""

    def __init__(self, shared, make_cache):
        self._shared, self._make_cache, self._cache, self._got = shared, make_cache, None, {}

    def __getitem__(self, recipe: str) -> tuple:
        if recipe not in self._got:
            self._got[recipe] = self._load_or_train(recipe)
        return self._got[recipe]

    def _train_here(self, recipe: str) -> tuple:
        if self._cache is None:
            self._cache = self._make_cache()
        return _train(recipe, self._cache)

    def _load_or_train(self, recipe: str) -> tuple:
        if self._shared is None:  # one process
            return self._train_here(recipe)
        store = self._shared / f"acceptance-run-{recipe}.pkl"
        with open(self._shared / f"acceptance-run-{recipe}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not store.exists():
                store.write_bytes(pickle.dumps(self._train_here(recipe)))
            return pickle.loads(store.read_bytes())


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """The seven runs, each trained once per test session (a worker that leaves the module and comes back rebuilds
    a module fixture, which then reads the stored runs)."""
    shared = (None if getattr(request.config, "workerinput", None) is None
              else tmp_path_factory.getbasetemp().parent)  # this session's folder, common to its workers
    return _Runs(shared, lambda: tmp_path_factory.mktemp("plab-cache"))


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r != "bf16"])
def test_every_recipe_trains_to_within_3_percent_of_bf16(runs, recipe):
    result, first, report = runs[recipe]  # before bf16's, so that two workers start on two recipes at once
    base, base_first, _ = runs["bf16"]
    assert result.status == "succeeded" and result.steps == STEPS
    assert result.gemm_backend == ("bf16" if report["converted_layers"] == 0 else "emulated")
    assert report["converted_layers"] > 0, f"{recipe} converted nothing on the tiny model"
    assert abs(first - base_first) / base_first < 0.01, (recipe, first, base_first)
    rel = abs(result.final_loss - base.final_loss) / base.final_loss
    assert rel < 0.03, f"{recipe}: final loss {result.final_loss:.4f} vs bf16 {base.final_loss:.4f} ({rel:.1%})"
    rel_val = abs(result.final_val_loss - base.final_val_loss) / base.final_val_loss
    assert rel_val < 0.03, f"{recipe}: val loss {result.final_val_loss:.4f} vs bf16 {base.final_val_loss:.4f}"


def test_bf16_baseline_actually_learned(runs):
    base, first, _ = runs["bf16"]
    assert base.final_loss < first - 1.0, "the baseline should learn, or the 3% comparison means little"
