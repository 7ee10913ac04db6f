"""randattn.estimate: one call, same draws whichever backend, seeds as ints or Generators."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
import torch

import randattn
import randattn.api
from randattn.testing import assert_close


@pytest.fixture
def qkv():
    rng = np.random.default_rng(0)
    return rng.standard_normal((2, 10, 6)), rng.standard_normal((2, 12, 6)), rng.standard_normal((2, 12, 4))


def test_reference_returns_numpy_and_torch_returns_tensor_on_device(qkv):
    q, k, v = qkv
    ref = randattn.estimate("rfa", q, k, v, num_samples=16, seed=1)
    bat = randattn.estimate("rfa", q, k, v, num_samples=16, seed=1, backend="torch", device="cpu")
    assert isinstance(ref, np.ndarray) and ref.dtype == np.float64 and ref.shape == (2, 10, 4)
    assert isinstance(bat, torch.Tensor) and bat.dtype == torch.float32 and bat.device.type == "cpu"


def test_seed_as_generator_gives_the_same_draws_as_the_int(qkv):
    q, k, v = qkv
    a = randattn.estimate("ra", q, k, v, num_samples=3, seed=5)
    b = randattn.estimate("ra", q, k, v, num_samples=3, seed=np.random.default_rng(5))
    assert np.array_equal(a, b)


def test_torch_inputs_work_with_the_reference_backend(qkv):
    q, k, v = qkv
    from_numpy = randattn.estimate("rfa", q, k, v, num_samples=8, seed=2)
    from_torch = randattn.estimate("rfa", *(torch.tensor(a) for a in qkv), num_samples=8, seed=2)
    assert_close(from_torch, from_numpy, atol=0)


def test_same_seed_same_draws_across_backends_so_a_run_is_checkable_by_its_seed(qkv):
    """float32 torch vs float64 reference from nothing but the seed: equal to float32 precision."""
    q, k, v = qkv
    ref = randattn.estimate("rfa", q, k, v, num_samples=32, seed=9, replicates=2, feature_map="hyperbolic")
    bat = randattn.estimate("rfa", q, k, v, num_samples=32, seed=9, replicates=2, feature_map="hyperbolic", backend="torch")
    assert_close(bat, ref, atol=5e-5, rtol=5e-5)


def test_default_scale_is_inverse_sqrt_head_dim(qkv):
    q, k, v = qkv
    assert_close(randattn.estimate("softmax", q, k, v), randattn.estimate("softmax", q, k, v, scale=6**-0.5), atol=0)


def test_bool_seed_is_rejected(qkv):
    with pytest.raises(TypeError, match="seed must be"):
        randattn.estimate("rfa", *qkv, num_samples=2, seed=True)


def test_docstring_examples_run():
    failures, _ = doctest.testmod(randattn.api, verbose=False)
    assert failures == 0


def test_catalogue_lists_every_estimator_with_parameters():
    records = {r["name"]: r for r in randattn.catalogue()}
    assert {"softmax", "rfa", "ra"} <= set(records)
    assert records["rfa"]["parameters"]["feature_map"]["choices"] == ["positive", "hyperbolic", "trigonometric", "regularized", "oprf", "sderf"]
    assert records["softmax"]["random"] is False and records["rfa"]["random"] is True
