"""RFA / Performer: the literal equations, the single-sample SNIS identity, convergence in S."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.special import softmax

import randattn
from randattn.estimators.features import POSITIVE_MAPS
from randattn.estimators.features import reference as fr
from randattn.estimators.rfa import reference as rfa_ref
from randattn.testing import assert_close


def _inputs(rng, n=6, m=5, d=4, dv=3, size=0.5):
    return rng.standard_normal((n, d)) * size, rng.standard_normal((m, d)) * size, rng.standard_normal((m, dv))


@pytest.mark.parametrize("feature_map", ["positive", "hyperbolic", "trigonometric", "regularized", "oprf", "sderf"])
def test_rfa_equals_literal_eq2_with_explicit_features(feature_map):
    """LARA eq. 2 with features exponentiated directly (safe at these small norms)."""
    rng = np.random.default_rng(1)
    q, k, v = _inputs(rng)
    scale = 0.7
    x, y = q * np.sqrt(scale), k * np.sqrt(scale)
    draws = randattn.draw("rfa", q.shape, k.shape, num_samples=32, seed=2, coupling="orthogonal")
    omega = draws["omega"][0]
    a = fr.oprf_optimal_a(x, y)
    sderf = fr.sderf_optimal_params(x, y)
    lx, sx = fr.log_features(feature_map, x, omega, oprf_a=a, sderf=sderf)
    ly, sy = fr.log_features(feature_map, y, omega, oprf_a=a, sderf=sderf)
    phi_x = np.exp(lx) * (1 if sx is None else sx)  # (N, S, L)
    phi_y = np.exp(ly) * (1 if sy is None else sy)  # (M, S, L)
    kernel = np.einsum("nsl,msl->nm", phi_x, phi_y)  # sum_s xi(x_n, w_s)^T xi(y_m, w_s)
    expected = kernel @ v / kernel.sum(-1, keepdims=True)
    got = rfa_ref.estimate(q, k, v, draws, scale=scale, feature_map=feature_map)[0]
    assert_close(got, expected, atol=1e-12, rtol=1e-12)


def test_rfa_with_one_feature_is_the_single_sample_snis_identity():
    """LARA eq. 4-6: with S = 1 the SNIS weight is 1 and RFA(q_n) = f(omega) for every query,
    f(omega) = sum_m xi(y_m, omega) v_m / sum_m xi(y_m, omega) (xi(x_n, omega) cancels)."""
    rng = np.random.default_rng(3)
    q, k, v = _inputs(rng)
    draws = randattn.draw("rfa", q.shape, k.shape, num_samples=1, seed=4)
    omega = draws["omega"][0, 0]
    y = k * q.shape[-1] ** -0.25
    xi_y = np.exp(y @ omega - 0.5 * (y * y).sum(-1))
    f = xi_y @ v / xi_y.sum()
    got = rfa_ref.estimate(q, k, v, draws)[0]
    assert_close(got, np.broadcast_to(f, got.shape), atol=1e-13, rtol=1e-13)


def _smreg_attention(q, k, v, scale):
    x, y = q * np.sqrt(scale), k * np.sqrt(scale)
    return softmax(fr.log_smreg(x, y), axis=-1) @ v


@pytest.mark.parametrize("feature_map", POSITIVE_MAPS)
@pytest.mark.parametrize("coupling", ["iid", "orthogonal"])
def test_rfa_error_falls_as_samples_grow(feature_map, coupling):
    """MSE over R = 300 replicates at S = 128 is below that at S = 4 by more than 4 combined SE
    (SE of an MSE = std of the per-replicate squared errors / sqrt(R)). The regularized map is
    measured against attention under its own kernel SMREG, to which it converges."""
    rng = np.random.default_rng(5)
    q, k, v = _inputs(rng, n=8, m=8, size=0.8)
    target = _smreg_attention(q, k, v, 0.5) if feature_map == "regularized" else randattn.estimate("softmax", q, k, v, scale=0.5)
    stats = {}
    for s in (4, 128):
        out = randattn.estimate("rfa", q, k, v, num_samples=s, seed=s, replicates=300, scale=0.5,
                                feature_map=feature_map, coupling=coupling)
        sq_err = ((out - target) ** 2).mean((-1, -2))
        stats[s] = (sq_err.mean(), sq_err.std(ddof=1) / np.sqrt(len(sq_err)))
    (mse_small, se_small), (mse_big, se_big) = stats[4], stats[128]
    assert mse_big + 4 * np.hypot(se_small, se_big) < mse_small, stats


def test_regularized_rfa_converges_to_smreg_attention_not_softmax():
    """Large S: regularized RFA is within 4 SE of SMREG attention and measurably off softmax."""
    rng = np.random.default_rng(6)
    q, k, v = _inputs(rng, n=4, m=5, d=3, size=1.5)
    out = randattn.estimate("rfa", q, k, v, num_samples=256, seed=7, replicates=400, scale=1.0, feature_map="regularized")
    mean, se = out.mean(0), out.std(0, ddof=1) / np.sqrt(out.shape[0])
    smreg = _smreg_attention(q, k, v, 1.0)
    soft = randattn.estimate("softmax", q, k, v, scale=1.0)
    # SNIS bias is O(1/S); at S = 256 it is far below the SE here
    assert np.abs((mean - smreg) / se).max() < 4
    assert np.abs((mean - soft) / se).max() > 4


def test_rfa_reference_never_builds_an_n_by_m_matrix():
    """Linear complexity (reference): at N = M = 4096 the peak numpy allocation (numpy reports
    its buffers to tracemalloc) stays far below one N x M float64 matrix (134 MB)."""
    import tracemalloc

    rng = np.random.default_rng(8)
    n, d = 4096, 4
    q, k, v = rng.standard_normal((3, n, d)) * 0.3
    draws = randattn.draw("rfa", q.shape, k.shape, num_samples=8, seed=0)
    tracemalloc.start()
    rfa_ref.estimate(q, k, v, draws)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < n * n * 8 / 10, f"peak {peak / 1e6:.1f} MB"


def test_rfa_batched_never_builds_an_n_by_m_tensor():
    """Linear complexity (torch): every op's output, recorded by a dispatch mode, has far
    fewer than N * M elements at N = M = 4096."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from randattn.estimators.rfa import batched

    class LargestOutput(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    LargestOutput.largest = max(LargestOutput.largest, t.numel())
            return out

    rng = np.random.default_rng(8)
    n, d = 4096, 4
    q, k, v = (torch.tensor(a) for a in rng.standard_normal((3, n, d)) * 0.3)
    draws = randattn.draw("rfa", q.shape, k.shape, num_samples=8, seed=0)
    with LargestOutput():
        batched.estimate(q, k, v, draws)
    assert 0 < LargestOutput.largest < n * n / 100, LargestOutput.largest


@pytest.mark.parametrize("feature_map", POSITIVE_MAPS)
@pytest.mark.parametrize("dtype_name", ["float64", "float32"])
def test_rfa_batched_is_exact_at_vit_key_norms(feature_map, dtype_name):
    """Keys of norm 150 (ViT-like; exp(x.y) overflows float64 far below): batched stays finite and,
    in float64, equals the reference to 1e-10; in float32 it stays within 1e-3 of it (the log-space
    forms add no epsilon and subtract the largest exponent before every exp)."""
    import torch

    rng = np.random.default_rng(9)
    q = rng.standard_normal((2, 40, 64)) * 3.0
    k = rng.standard_normal((2, 37, 64))
    k *= 150.0 / np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((2, 37, 8))
    draws = randattn.draw("rfa", q.shape, k.shape, num_samples=16, seed=3, replicates=2)
    expected = rfa_ref.estimate(q, k, v, draws, feature_map=feature_map)
    from randattn.estimators.rfa import batched

    dtype = getattr(torch, dtype_name)
    got = batched.estimate(*(torch.tensor(a, dtype=dtype) for a in (q, k, v)), draws.to_torch(dtype=dtype),
                           feature_map=feature_map).double().numpy()
    assert np.isfinite(got).all()
    assert_close(got, expected, atol=1e-10 if dtype_name == "float64" else 1e-3, rtol=0)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_batched_rejects_non_finite_torch_inputs_but_accepts_sums_that_overflow(bad):
    """The finiteness test sums first (one pass); a sum that overflows falls back to the elementwise test."""
    import torch

    from randattn.estimators.rfa import batched

    q = torch.full((4, 3), 3e38, dtype=torch.float32)  # finite, but the sum overflows float32
    draws = randattn.draw("rfa", q.shape, q.shape, num_samples=2, seed=0)
    out = batched.estimate(q * 1e-37, q * 1e-37, q, draws.to_torch(dtype=torch.float32))
    assert torch.isfinite(out).all()
    batched.estimate(q * 1e-37, q * 1e-37, q.clone(), draws.to_torch(dtype=torch.float32))  # v with an overflowing sum
    broken = q.clone() * 1e-37
    broken[1, 2] = bad
    with pytest.raises(ValueError, match="NaN or infinite|finite"):
        batched.estimate(broken, q * 1e-37, q, draws.to_torch(dtype=torch.float32))
