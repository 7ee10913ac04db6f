"""The factored probability error and its rounding bound (analysis.probability_error).

Expected values are the dense sum sum_n ||L_n R - P_n||^2 in float64 numpy, from the same float32
factors (an independent computation: no expansion, no cancellation).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from randattn.analysis.probability_error import (
    RANK_FRACTION,
    factored_pays,
    factored_rounding_negligible,
    factored_sq_errors,
)
from randattn.estimators.masks import Mask


def _softmax(a: np.ndarray) -> np.ndarray:
    e = np.exp(a - a.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _dense(left, right, exact64) -> np.ndarray:
    """sum_n ||L_n R - P_n||^2 (R, ...) in float64, from the float32 factors upcast exactly."""
    diff = np.asarray(left, np.float64) @ np.asarray(right, np.float64) - exact64
    return (diff * diff).sum((-2, -1))


def _call(left, right, exact64, dtype=torch.float32):
    return factored_sq_errors(torch.as_tensor(left, dtype=dtype), torch.as_tensor(right, dtype=dtype),
                              torch.as_tensor(exact64, dtype=dtype), torch.as_tensor((exact64 * exact64).sum(-1)))


def _factors(rng, reps, batch, n, j, m, signed):
    left = _softmax(rng.normal(size=(reps, *batch, n, j)) * 2)
    if signed:  # LARA's decoupled weights over their normalizer: mixed signs, rows summing to about 1
        left = left + rng.normal(size=left.shape) * 0.3
    right = _softmax(rng.normal(size=(reps, *batch, j, m)) * 3)
    exact = _softmax(rng.normal(size=(*batch, n, m)) * 3)
    return left.astype(np.float32), right.astype(np.float32), exact


@pytest.mark.parametrize("signed", [False, True], ids=["positive", "signed"])
@pytest.mark.parametrize("batch", [(), (3,), (2, 2)], ids=["nobatch", "b3", "b2x2"])
def test_factored_errors_are_the_dense_sum_within_their_bound(signed, batch, rng):
    left, right, exact = _factors(rng, 4, batch, 30, 5, 23, signed)
    sq, bound = _call(left, right, exact)
    expected = _dense(left, right, exact)
    assert sq.shape == bound.shape == (4, *batch) and sq.dtype == bound.dtype == torch.float64
    assert (np.abs(sq.numpy() - expected) <= bound.numpy()).all()
    # usable: the bound is far below the 1e-3 of the error that the sweep asks of it
    assert factored_rounding_negligible(sq, bound, 1e-3)
    assert (bound.numpy() < 1e-4 * expected).all()


def test_signed_factors_get_the_bound_of_their_magnitudes(rng):
    """With L of both signs the bound uses |L|: it is larger than the positive part's bound would say."""
    left, right, exact = _factors(rng, 2, (), 40, 6, 31, signed=True)
    _, bound = _call(left, right, exact)
    _, positive_bound = _call(np.clip(left, 0, None), right, exact)
    _, flipped = _call(-left, right, exact)  # the same magnitudes
    assert torch.allclose(bound, flipped, rtol=1e-6)
    assert (bound > 0).all() and not torch.equal(bound, positive_bound)


def test_a_near_exact_estimate_is_refused(rng):
    """P = L R exactly (in float64): e^2 = 0, so any rounding is not negligible against it; the bound still covers
    the computed value's distance from 0."""
    left, right, _ = _factors(rng, 2, (2,), 25, 4, 19, signed=False)
    exact = np.asarray(left, np.float64) @ np.asarray(right, np.float64)  # rows sum to 1: a probability matrix
    sq, bound = _call(left, right, exact[0])  # replicate 0's own product: its error is 0
    truth = _dense(left, right, exact[0])
    assert truth[0].max() < 1e-25
    assert (np.abs(sq.numpy() - truth) <= bound.numpy()).all()
    assert not factored_rounding_negligible(sq, bound, 1e-3)


def test_the_bound_covers_products_that_underflow():
    """L = 1e20 and R = 1e-25: every entry of R R^T (1e-50) underflows to 0 in float32, so the computed
    ||P_hat_n||^2 is 0 while the true one is M J^2 1e-10. Only the bound's underflow terms cover that: its
    rounding terms (gamma_K times the computed magnitudes) are far smaller than the error."""
    n, j, m = 3, 4, 1000
    left = np.full((1, n, j), 1e20, np.float32)
    right = np.full((1, j, m), 1e-25, np.float32)
    exact = np.full((n, m), 1.0 / m)
    sq, bound = _call(left, right, exact)
    error = np.abs(sq.numpy() - _dense(left, right, exact))
    assert error[0] > 1e-7  # M J^2 1e-10 per row, lost
    assert error[0] <= bound.numpy()[0]
    gamma_part = (m + 2 * j + 6) * 2.0**-24 * 1.01 * 3 * n * (j * 1e20 * 1e-25 * 1.0)  # >= gamma_K (Q + 2C)
    assert gamma_part < error[0]


def test_overflow_is_refused(rng):
    """Factors beyond float32's range give inf or NaN, which the rule refuses."""
    left, right, exact = _factors(rng, 1, (), 10, 3, 8, signed=True)
    sq, bound = _call(left * 1e25, right, exact)
    assert not (torch.isfinite(sq).all() and torch.isfinite(bound).all())
    assert not factored_rounding_negligible(sq, bound, 1.0)


def test_bad_factors_are_named():
    ok = torch.full((1, 2, 2), 0.5)
    with pytest.raises(TypeError, match="float32 or float64"):
        factored_sq_errors(ok.double(), ok, ok[0], torch.ones(2, dtype=torch.float64))
    with pytest.raises(TypeError, match="float32 or float64"):
        factored_sq_errors(ok.half(), ok.half(), ok[0].half(), torch.ones(2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        factored_sq_errors(ok, ok * 3, ok[0], torch.ones(2, dtype=torch.float64))


def test_negligible_rule_on_hand_values():
    """bound <= rtol (sq - bound), for every entry (at sq = 1 the limit is rtol / (1 + rtol)); NaN or inf fails."""
    sq = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
    assert factored_rounding_negligible(sq, torch.tensor([[0.9999e-3 / 1.001, 1e-3]], dtype=torch.float64), 1e-3)
    assert not factored_rounding_negligible(sq, torch.tensor([[1e-3, 1e-3]], dtype=torch.float64), 1e-3)
    assert not factored_rounding_negligible(sq, torch.tensor([[0.0, float("nan")]], dtype=torch.float64), 1.0)
    assert not factored_rounding_negligible(torch.tensor([[float("inf")]]), torch.tensor([[0.0]]), 1.0)


def test_factored_pays_below_the_rank_fraction():
    assert RANK_FRACTION == 16
    assert factored_pays(16, 256) and not factored_pays(16, 255)
    assert factored_pays(32, 577) and not factored_pays(64, 785) and not factored_pays(16, 197)
    assert not factored_pays(None, 10_000)


def test_no_finite_bound_past_its_range_of_validity(rng):
    """The bound's factor 1.01 needs K u <= 1e-3 with K = M + 2J + 6: in float32 K = 16,777 is the last (the sweep
    goes dense past it); float64 reaches far beyond."""
    left, right, exact = _factors(rng, 1, (), 2, 1, 16_769, signed=False)
    assert torch.isfinite(_call(left, right, exact)[1]).all()  # K = 16,777
    left, right, exact = _factors(rng, 1, (), 2, 1, 16_770, signed=False)
    assert torch.isinf(_call(left, right, exact)[1]).all()
    assert torch.isfinite(_call(left, right, exact, torch.float64)[1]).all()


@pytest.mark.parametrize("signed", [False, True], ids=["positive", "signed"])
def test_float64_factors_are_the_dense_sum_within_a_float64_bound(signed, rng):
    """The same contract in float64 (the sweep's second try): the bound shrinks by about 2^29."""
    left, right, exact = _factors(rng, 3, (2,), 30, 5, 23, signed)
    left, right = left.astype(np.float64) + 1e-9, right.astype(np.float64)  # not float32 values
    sq, bound = _call(left, right, exact, torch.float64)
    expected = _dense(left, right, exact)
    assert (np.abs(sq.numpy() - expected) <= bound.numpy()).all()
    _, bound32 = _call(left.astype(np.float32), right.astype(np.float32), exact)
    assert (bound.numpy() < 1e-7 * bound32.numpy()).all() and (bound.numpy() < 1e-12 * expected).all()


def test_a_near_exact_estimate_is_refused_in_float64_too(rng):
    """e^2 = 0 exactly: no precision makes its rounding negligible against it, so the sweep goes dense."""
    left, right, _ = _factors(rng, 1, (), 25, 4, 19, signed=False)
    exact = np.asarray(left, np.float64) @ np.asarray(right, np.float64)
    sq, bound = _call(left, right, exact[0], torch.float64)
    assert not factored_rounding_negligible(sq, bound, 1e-3)


def test_an_estimator_without_a_probability_form_is_measured_by_one_hot_tiles_above_the_identity_size(monkeypatch):
    """local and scatterbrain declare no probability form: with 1,100 keys (a 1.2M-entry identity, above 2^20) and
    the last 64 causal queries (a dense truth), their probability error comes from one-hot value columns a tile at a time,
    never an M x M identity (torch.eye is made to fail), and equals the identity's (forced by raising the threshold)
    to 1e-10 relative: the same terms summed in another order."""
    import torch

    from randattn.activations import make_activations
    from randattn.analysis import estimate_block
    from randattn.analysis.plan import SweepConfig, parse_estimator_list
    from randattn.analysis.sweep import run_sweep

    rng = np.random.default_rng(2)
    acts = make_activations({0: tuple(0.5 * rng.normal(size=(1, 2, 1100, 8)) for _ in range(3))},
                            {"scale": 8 ** -0.5, "layout": "sequence"})
    config = SweepConfig(estimators=parse_estimator_list("local:window=64;scatterbrain:window=64"), num_samples=(8,),
                         replicates=3, seed=1, threads=1, dtype="float64", mask="causal", diagnostics=False,
                         check_reference=0.0, queries="last:64")
    eye = torch.eye
    with monkeypatch.context() as patch:
        patch.setattr(torch, "eye", lambda *a, **k: pytest.fail("an identity was made"))
        tiles = run_sweep(acts, config)
    with monkeypatch.context() as patch:
        patch.setattr(estimate_block, "IDENTITY_ABOVE", 2**40)
        patch.setattr(torch, "eye", eye)
        identity = run_sweep(acts, config)
    assert np.isfinite(tiles.prob_mse).all()
    np.testing.assert_allclose(tiles.prob_mse, identity.prob_mse, rtol=1e-10, atol=0)
    np.testing.assert_array_equal(tiles.mse, identity.mse)  # the estimates are the same calls


@pytest.mark.parametrize("faulty", [True, False], ids=["weight-on-hidden-keys", "weight-on-visible-keys"])
@pytest.mark.parametrize(("mask", "formed"), [("sliding:6", [3, 4]), ("sliding:9", [3, 4]),
                                              ("causal", [0, 1, 2, 3, 4]), (None, [0, 1, 2, 3, 4])])
def test_tiles_before_every_window_are_not_formed_and_their_estimates_still_count(monkeypatch, mask, formed, faulty):
    """8 queries, the last of 40 tokens, tiles of 8 keys: under sliding:6 the first query's window starts at key
    40 - 8 - 6 + 1 = 27, so tiles 0-2 (keys 0-23) hold exact zeros and are not formed; under sliding:9 the first
    visible key, 24, starts tile 3; causal and no mask form every tile (the last query sees every key). The sum
    equals the dense numpy sum of (P_hat - P)^2 over every key: where P_hat puts weight on hidden keys (a faulty
    estimator) those squares count; where it gives them none, the hidden tiles add nothing and are not summed."""
    from randattn.analysis import probability_error
    from randattn.estimators.softmax import tiled

    rng = np.random.default_rng(4)
    n, m, d, reps = 8, 40, 4, 2
    q, k = torch.as_tensor(rng.normal(size=(1, n, d)) * 3), torch.as_tensor(rng.normal(size=(1, m, d)) * 3)
    logits = (q @ k.transpose(-1, -2)).numpy() * d ** -0.5
    visible = np.ones((n, m), bool) if mask is None else Mask.parse(mask).visible(n, m)
    exact = np.where(visible, np.exp(logits - logits.max(-1, keepdims=True)), 0.0)
    exact /= exact.sum(-1, keepdims=True)
    estimate = rng.dirichlet(np.ones(m), size=(reps, 1, n))
    if not faulty:
        estimate = np.where(visible, estimate, 0.0)
    expected = ((estimate - exact) ** 2).sum((-2, -1))
    log_z = torch.as_tensor(np.log(np.where(visible, np.exp(logits), 0.0).sum(-1)))
    formed_tiles, summed = [], []
    original, vecdot = tiled.tiled_probabilities, torch.linalg.vecdot

    def counted(*args, key_slice, **kwargs):
        formed_tiles.append(key_slice.start // 8)
        return original(*args, key_slice=key_slice, **kwargs)

    monkeypatch.setattr(tiled, "tiled_probabilities", counted)
    monkeypatch.setattr(torch.linalg, "vecdot", lambda *a, **kw: summed.append(1) or vecdot(*a, **kw))
    got = probability_error.tiled_sq_errors(lambda k0, k1: torch.as_tensor(estimate[..., k0:k1]), q, k, log_z,
                                            scale=d ** -0.5, mask=mask, key_tile=8)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=0)
    assert formed_tiles == formed
    assert len(summed) == (5 if faulty or not str(mask).startswith("sliding") else 2)
