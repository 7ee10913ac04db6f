"""Shared fixtures, and torch's thread pool sized to a pytest-xdist worker's share of the cores."""

from __future__ import annotations

import os

import numpy as np
import pytest


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (``-n W``) each worker's torch pool gets ``cores // W`` threads: W pools of every core
    spin against each other (the default run on the 2-core AVX2 host: 328 s serially, 310 s with ``-n 2`` and
    torch's own pools, 218 s with one thread a worker)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20221121)
