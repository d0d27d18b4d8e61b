"""Precision tests run many small tensor ops; on the shared 2-core machine two intra-op threads contending
with other processes made them 5x slower than one thread, so these tests use one."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
