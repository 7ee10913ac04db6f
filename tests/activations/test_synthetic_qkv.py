"""Synthetic generators: shapes, norms, reproducibility, and that the hard cases are hard."""

from __future__ import annotations

import numpy as np
import pytest

from randattn.activations.stats import attention_entropy
from randattn.activations.synthetic import gaussian_qkv, huge_key, near_duplicate_keys, sink_token


def test_gaussian_shapes_norms_and_seed():
    s = gaussian_qkv(7, 5, m=9, dv=3, batch=(2, 4), q_norm=3.0, k_norm=0.5, rng=1)
    assert s.q.shape == (2, 4, 7, 5) and s.k.shape == (2, 4, 9, 5) and s.v.shape == (2, 4, 9, 3)
    np.testing.assert_allclose(np.linalg.norm(s.q, axis=-1), 3.0, rtol=1e-12)
    np.testing.assert_allclose(np.linalg.norm(s.k, axis=-1), 0.5, rtol=1e-12)
    assert s.scale == 5**-0.5
    again = gaussian_qkv(7, 5, m=9, dv=3, batch=(2, 4), q_norm=3.0, k_norm=0.5, rng=np.random.default_rng(1))
    np.testing.assert_array_equal(s.q, again.q)
    np.testing.assert_array_equal(s.v, again.v)


def test_temperature_controls_entropy():
    hot = gaussian_qkv(16, 8, q_norm=1.0, k_norm=1.0, rng=0)
    cold = gaussian_qkv(16, 8, q_norm=30.0, k_norm=30.0, rng=0)
    assert attention_entropy(hot.q, hot.k, hot.scale).mean() > np.log(16) - 0.1
    assert attention_entropy(cold.q, cold.k, cold.scale).mean() < 1.0


def test_huge_key_has_the_norm():
    s = huge_key(10, 64, norm=150.0, index=3, rng=0)
    norms = np.linalg.norm(s.k, axis=-1)
    assert norms[3] == pytest.approx(150.0) and np.allclose(np.delete(norms, 3), 1.0)


def test_near_duplicates_are_near():
    s = near_duplicate_keys(12, 6, copies=4, jitter=1e-4, rng=2)
    spread = np.abs(s.k[1:4] - s.k[0]).max()
    assert 0 < spread < 1e-3
    assert np.abs(s.k[4] - s.k[0]).max() > 0.1


def test_sink_takes_most_attention():
    s = sink_token(50, 16, strength=12.0, index=0, rng=3)
    logits = s.scale * s.q @ s.k.T
    assert logits[:, 0].mean() == pytest.approx(12.0)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    assert weights[:, 0].mean() > 0.9


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [({"n": 0, "d": 3}, ValueError, "n must be >= 1, got 0"), ({"n": 2, "d": 3.0}, TypeError, "d must be an int"),
     ({"n": 2, "d": 3, "q_norm": -1}, ValueError, "q_norm must be finite and >= 0"),
     ({"n": 2, "d": 3, "scale": 0}, ValueError, "scale must be positive")],
)
def test_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        gaussian_qkv(**kwargs)
