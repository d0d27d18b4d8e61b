"""`training.perf.overlap_optimizer`: true, false or null (auto). Auto overlaps the update with the next forward
under FSDP2 only, and runs it after the backward otherwise (one GPU, DDP), where H100s measured no gain from
overlapping (bench/NOTES_floor.md 32, 36, 39)."""
import pytest

from training.config import RunSpec, SpecError
from training.setup import overlap_update


@pytest.mark.parametrize("option, parallel, expected", [
    (None, "single", False),
    (None, "ddp", False),
    (None, "fsdp", True),
    (True, "single", True),
    (True, "ddp", True),
    (False, "fsdp", False),
])
def test_auto_overlaps_only_under_fsdp2_and_an_explicit_value_wins(option, parallel, expected):
    assert overlap_update(option, parallel) is expected


def test_spec_takes_true_false_or_null_and_names_the_choices_otherwise(make_spec):
    assert RunSpec.from_dict(make_spec()).training.perf.overlap_optimizer is None
    for value in (True, False, None):
        spec = RunSpec.from_dict(make_spec(training={"perf": {"overlap_optimizer": value}}))
        assert spec.training.perf.overlap_optimizer is value
    expected = (r"training.perf.overlap_optimizer must be true, false or null \(auto: overlapped under FSDP2 only, "
                r"not on its one-rank direct path\)")
    with pytest.raises(SpecError, match=expected + r", got 'auto'"):
        RunSpec.from_dict(make_spec(training={"perf": {"overlap_optimizer": "auto"}}))


def test_a_cpu_run_reports_its_update_serial(make_spec, cache_dir):
    from training.sink import ListSink
    from training.train import train
    result = train(make_spec(training={"steps": 2, "perf": {"overlap_optimizer": True}}), ListSink(),
                   cache_dir=cache_dir)
    assert result.status == "succeeded"
    assert result.summary["overlap_optimizer"] is False  # the side stream is CUDA's: a CPU run is always serial


def test_fuse_qkv_takes_true_false_or_null_and_says_so(make_spec):
    from training.config import RunSpec, SpecError

    for value in (True, False, None):
        assert RunSpec.from_dict(make_spec(training={"perf": {"fuse_qkv": value}})).training.perf.fuse_qkv is value
    with pytest.raises(SpecError, match=r"training.perf.fuse_qkv must be true, false or null \(auto: on for GPU runs"):
        RunSpec.from_dict(make_spec(training={"perf": {"fuse_qkv": "yes"}}))
