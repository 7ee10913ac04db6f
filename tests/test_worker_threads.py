"""The default run's pytest-xdist workers each get their share of the cores for torch (tests/conftest.py).

Two workers on two cores with torch's own pools (two threads each) took 310 s against 218 s with one thread a
worker (benchmarks/RESULTS.md, test suite): the sizing is what keeps the README's test command under five minutes.
"""

from __future__ import annotations

import os

import pytest
import torch


def test_an_xdist_worker_gets_its_share_of_the_cores_for_torch():
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers:
        pytest.skip("not run on pytest-xdist workers (the README's command runs it there)")
    assert torch.get_num_threads() == max(1, (os.cpu_count() or 1) // int(workers))
