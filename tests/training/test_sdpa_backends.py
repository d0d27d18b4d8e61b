"""training.perf.sdpa_backend: a pinned backend holds for its run only. torch's SDPA flags are process-wide, so a
run pinned to math left every later run in the process (the GPU tests, a notebook) on math."""
import pytest
import torch

from training.setup import set_sdpa_backends

FLAGS = ("flash", "mem_efficient", "cudnn", "math")


def _flags() -> dict[str, bool]:
    return {f: getattr(torch.backends.cuda, f"{f}_sdp_enabled")() for f in FLAGS}


@pytest.fixture(autouse=True)
def restore_flags():
    before = _flags()
    yield
    set_sdpa_backends("auto")
    for flag, on in before.items():
        getattr(torch.backends.cuda, f"enable_{flag}_sdp")(on)


def test_a_pinned_backend_turns_the_others_off_and_auto_gives_the_processs_flags_back():
    torch.backends.cuda.enable_mem_efficient_sdp(False)  # the process's own choice before any run
    before = _flags()
    assert before["mem_efficient"] is False and before["math"] is True
    set_sdpa_backends("math")
    assert _flags() == {"flash": False, "mem_efficient": False, "cudnn": False, "math": True}
    set_sdpa_backends("efficient")  # a second pinned run: the flags to give back are still the process's own
    assert _flags() == {"flash": False, "mem_efficient": True, "cudnn": False, "math": False}
    set_sdpa_backends("auto")
    assert _flags() == before
    set_sdpa_backends("auto")  # nothing pinned: left as they are
    assert _flags() == before
    set_sdpa_backends("cudnn")
    assert _flags() == {"flash": False, "mem_efficient": False, "cudnn": True, "math": False}
    set_sdpa_backends("auto")
    assert _flags() == before
