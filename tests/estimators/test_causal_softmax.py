"""Exact softmax attention under ``mask="causal"`` (ARCHITECTURE sec. 12): the -inf logits before the
max-subtracted softmax, against a loop over queries written out here, independently of the package.

Tolerances: exact attention has no Monte Carlo error, so the forms agree to rounding: 1e-12 in float64;
float32 at norms 150-200 within ``8 L eps32 max|v|`` (the rounding of a logit of size L, as the conformance
kit's bound in ``randattn.testing.checks``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import randattn
from randattn.estimators.masks import Mask, causal_visible
from randattn.estimators.softmax import SPEC
from randattn.estimators.softmax import batched as softmax_batched
from randattn.estimators.softmax import reference as softmax_ref
from randattn.testing import assert_close

EPS32 = float(np.finfo(np.float32).eps)


def _inputs(seed: int, n: int, m: int, *, batch=(2,), d=5, dv=3, size=1.0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((*batch, n, d)) * size, rng.standard_normal((*batch, m, d)) * size,
            rng.standard_normal((*batch, m, dv)))


def _t(*arrays, dtype=torch.float64):
    return [torch.as_tensor(a, dtype=dtype) for a in arrays]


def _loop_softmax(q, k, v, *, offset=0, window=None):
    """y_n = sum_{m visible} e^{s q_n.k_m} v_m / sum_{m visible} e^{s q_n.k_m}, key m visible iff
    m <= n + (M - N) + ``offset`` (and, with ``window`` W, m > n + (M - N) - W), one query at a time (shifted by
    its largest visible logit); NaN where none."""
    scale = q.shape[-1] ** -0.5
    n_q, n_k = q.shape[-2], k.shape[-2]
    out = np.full((*v.shape[:-2], n_q, v.shape[-1]), np.nan)
    for b in np.ndindex(*q.shape[:-2]):
        for n in range(n_q):
            last = n + (n_k - n_q) + offset
            first = 0 if window is None else max(n + (n_k - n_q) - window + 1, 0)
            if last < first:
                continue
            logits = scale * k[b][first: last + 1] @ q[b][n]
            weights = np.exp(logits - logits.max())
            out[b][n] = weights @ v[b][first: last + 1] / weights.sum()
    return out


@pytest.mark.parametrize("window", [1, 3, 9])
@pytest.mark.parametrize("n, m", [(1, 1), (7, 7), (5, 9), (1, 6)], ids=["N1-M1", "N7-M7", "N5-M9", "N1-M6"])
def test_a_sliding_window_in_both_forms_equals_the_loop_over_queries(n, m, window):
    """``mask="sliding:W"``: each query's last W visible keys (W = 9 covers every key: the causal output)."""
    q, k, v = _inputs(2, n, m)
    expected = _loop_softmax(q, k, v, window=window)
    mask = f"sliding:{window}"
    assert_close(softmax_ref.estimate(q, k, v, mask=mask), expected, atol=1e-12, rtol=1e-12, what="reference:")
    assert_close(softmax_batched.estimate(*_t(q, k, v), mask=mask), expected, atol=1e-12, rtol=1e-12,
                 what="batched:")
    probabilities = softmax_ref.attention_probabilities(q, k, mask=mask)
    assert np.array_equal(probabilities != 0, np.broadcast_to(Mask.parse(mask).visible(n, m), probabilities.shape))


@pytest.mark.parametrize("n, m", [(1, 1), (7, 7), (5, 9), (1, 6)], ids=["N1-M1", "N7-M7", "N5-M9", "N1-M6"])
def test_both_forms_equal_the_loop_over_queries(n, m):
    q, k, v = _inputs(1, n, m)
    expected = _loop_softmax(q, k, v)
    assert_close(softmax_ref.estimate(q, k, v, mask="causal"), expected, atol=1e-12, rtol=1e-12, what="reference:")
    assert_close(softmax_batched.estimate(*_t(q, k, v), mask="causal"), expected, atol=1e-12, rtol=1e-12,
                 what="batched:")


@pytest.mark.parametrize("offset", [-1, 1], ids=["m<n", "m<=n+1"])
def test_negative_control_an_off_by_one_mask_fails_the_comparison(offset):
    q, k, v = _inputs(2, 8, 8)
    wrong = _loop_softmax(q, k, v, offset=offset)[..., 1:, :]
    for ours in (softmax_ref.estimate(q, k, v, mask="causal"),
                 softmax_batched.estimate(*_t(q, k, v), mask="causal").numpy()):
        assert np.abs(ours[..., 1:, :] - wrong).max() > 1e-3
        with pytest.raises(AssertionError, match="not close"):
            assert_close(ours[..., 1:, :], wrong, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("n, m", [(10, 10), (6, 10)], ids=["N10-M10", "N6-M10"])
def test_junk_after_the_last_visible_key_changes_nothing(n, m):
    """Hidden keys and values replaced by junk (norms x 50, values x 1e3): bit-identical outputs in both forms."""
    q, k, v = _inputs(3, n, m)
    ref = softmax_ref.estimate(q, k, v, mask="causal")
    bat = softmax_batched.estimate(*_t(q, k, v), mask="causal")
    rng = np.random.default_rng(4)
    for cut in range(n - 1):
        hidden = slice(cut + (m - n) + 1, None)
        k2, v2 = k.copy(), v.copy()
        k2[..., hidden, :] = rng.standard_normal(k2[..., hidden, :].shape) * 50
        v2[..., hidden, :] = rng.standard_normal(v2[..., hidden, :].shape) * 1e3
        assert np.array_equal(softmax_ref.estimate(q, k2, v2, mask="causal")[..., : cut + 1, :], ref[..., : cut + 1, :])
        bat2 = softmax_batched.estimate(*_t(q, k2, v2), mask="causal")
        assert torch.equal(bat2[..., : cut + 1, :], bat[..., : cut + 1, :])


def test_one_visible_key_and_the_last_query():
    """Query 0 of self-attention sees key 0 only: exactly v_0. The last query sees every key: exactly the
    bidirectional output (its row has no hidden logit)."""
    q, k, v = _inputs(5, 9, 9)
    for form, args in ((softmax_ref.estimate, (q, k, v)), (softmax_batched.estimate, _t(q, k, v))):
        causal, both = np.asarray(form(*args, mask="causal")), np.asarray(form(*args))
        assert np.array_equal(causal[..., 0, :], v[..., 0, :])
        assert np.array_equal(causal[..., -1, :], both[..., -1, :])


def test_probabilities_are_zero_at_hidden_keys_and_reproduce_the_estimate():
    q, k, v = _inputs(6, 7, 11)
    probs = softmax_ref.attention_probabilities(q, k, mask="causal")
    hidden = ~causal_visible(7, 11)
    assert (probs[..., hidden] == 0).all()
    assert_close(probs.sum(-1), np.ones(probs.shape[:-1]), atol=1e-14, rtol=0)
    assert_close(probs @ v, softmax_ref.estimate(q, k, v, mask="causal"), atol=1e-14, rtol=1e-14)
    bidirectional = softmax_ref.attention_probabilities(q, k)
    assert np.array_equal(bidirectional, softmax_ref.attention_probabilities(q, k, mask=None))


@pytest.mark.parametrize("dtype_name", ["float64", "float32"])
def test_norms_150_to_200(dtype_name):
    """Query and key norms 150-200: finite in both dtypes; float64 equal to the reference to 1e-12 (times
    max|v|), float32 within the rounding of its logits."""
    rng = np.random.default_rng(7)
    q, k = rng.standard_normal((2, 2, 40, 16))
    q *= rng.uniform(150, 200, (2, 40, 1)) / np.linalg.norm(q, axis=-1, keepdims=True)
    k *= rng.uniform(150, 200, (2, 40, 1)) / np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((2, 40, 4))
    ref = softmax_ref.estimate(q, k, v, mask="causal")
    dtype = getattr(torch, dtype_name)
    got = softmax_batched.estimate(*_t(q, k, v, dtype=dtype), mask="causal")
    assert torch.isfinite(got).all()
    largest_logit = max(np.abs(q @ np.swapaxes(k, -1, -2)).max(), (q * q).sum(-1).max(), (k * k).sum(-1).max()) / 4
    atol = 1e-12 * np.abs(v).max() if dtype_name == "float64" else 8 * largest_logit * EPS32 * np.abs(v).max()
    assert_close(got, ref, atol=atol, rtol=0.0)


def test_bad_masks_and_shapes_name_the_problem():
    q, k, v = _inputs(8, 6, 4)
    with pytest.raises(ValueError, match="at least as many keys as queries"):
        softmax_ref.estimate(q, k, v, mask="causal")
    with pytest.raises(ValueError, match="at least as many keys as queries"):
        softmax_batched.estimate(*_t(q, k, v), mask="causal")
    for form, args in ((softmax_ref.estimate, (k, k, v)), (softmax_batched.estimate, _t(k, k, v))):
        with pytest.raises(ValueError, match="mask"):
            form(*args, mask="sideways")


def test_through_the_api_and_the_spec():
    q, k, v = _inputs(9, 5, 8)
    assert SPEC.supports_mask("causal")
    ref = randattn.estimate("softmax", q, k, v, mask="causal")
    bat = randattn.estimate("softmax", q, k, v, mask="causal", backend="torch", dtype=torch.float64)
    assert_close(ref, _loop_softmax(q, k, v), atol=1e-12, rtol=1e-12)
    assert_close(bat, ref, atol=1e-12, rtol=1e-12)
    draws = randattn.draw("softmax", q.shape, k.shape, replicates=3, mask="causal")
    assert SPEC.reference(q, k, v, draws, mask="causal").shape == (3, 2, 5, 3)
