"""Random-feature kernels: unbiasedness for every map and coupling, couplings' geometry, SMREG, OPRF, SDERF."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from randattn.estimators.features import FEATURE_MAPS
from randattn.estimators.features import batched as fb
from randattn.estimators.features import reference as fr
from randattn.estimators.sampling import COUPLINGS, draw_omegas, haar_orthogonal, simplex_directions
from randattn.testing import assert_close

UNBIASED_COUPLINGS = ("iid", "orthogonal", "simplex")


def _small_pair(rng, dim=4, n=2, m=3):
    """Inputs with |x + y|^2 <= 2, where every map's variance is finite and moderate."""
    x = rng.standard_normal((n, dim))
    y = rng.standard_normal((m, dim))
    x *= 0.35 / np.linalg.norm(x, axis=-1, keepdims=True)
    y *= 0.35 / np.linalg.norm(y, axis=-1, keepdims=True)
    assert (np.linalg.norm(x[:, None] + y[None], axis=-1) ** 2 <= 2).all()
    return x, y


def _z_scores(estimates: np.ndarray, target: np.ndarray) -> np.ndarray:
    """(mean - target) / SE with SE = sample std / sqrt(R) over independent replicates."""
    r = estimates.shape[0]
    se = estimates.std(0, ddof=1) / np.sqrt(r)
    return (estimates.mean(0) - target) / se


KERNEL_CASES = list(itertools.product(FEATURE_MAPS, UNBIASED_COUPLINGS))


@pytest.mark.parametrize("feature_map, coupling", KERNEL_CASES)
def test_kernel_estimates_are_unbiased(feature_map, coupling):
    """Mean of R = 4000 kernel estimates within 4 SE of exp(x.y) (SMREG for 'regularized').

    SE = replicate std / sqrt(R); replicates are independent even when the S = 8 features
    inside one are coupled. 6 entries x 15 (map, coupling) cases at 4 SE: a false alarm
    has probability < 90 * 6.3e-5 ~ 0.6% for a correct estimator (fixed seed: deterministic).
    """
    rng = np.random.default_rng(KERNEL_CASES.index((feature_map, coupling)))
    x, y = _small_pair(rng)
    omega = draw_omegas(rng, (4000,), 8, x.shape[-1], coupling)
    estimates = fr.kernel_estimate(feature_map, x, y, omega)  # omega broadcasts: (R, N, M)
    target = fr.exact_kernel(feature_map, x, y)
    z = _z_scores(estimates, target)
    assert np.abs(z).max() < 4, f"max |z| = {np.abs(z).max():.2f}"


def test_plain_qr_orthogonal_features_are_biased_and_sign_fix_is_not():
    """At D = 4, plain-QR orthogonal positive features underestimate exp(x.y) (E[Q_ii] < 0).

    x = y along e_1 with |x + y|^2 = 2: the plain estimator is far below the truth (> 10 SE),
    the sign-fixed one within 4 SE.
    """
    rng = np.random.default_rng(4)
    x = np.array([[np.sqrt(0.5), 0.0, 0.0, 0.0]])
    target = fr.exact_kernel("positive", x, x)
    z = {}
    for coupling in ("orthogonal-plain-qr", "orthogonal"):
        omega = draw_omegas(rng, (20000,), 4, 4, coupling)
        z[coupling] = _z_scores(fr.kernel_estimate("positive", x, x, omega), target).item()
    assert z["orthogonal-plain-qr"] < -10, z
    assert abs(z["orthogonal"]) < 4, z


def test_haar_sign_fix_diagonal_mean_is_zero():
    """E[Q_11] = 0 for Haar Q; plain QR gives E[Q_11] < 0 (mean of 20000 at D=4, 4 SE)."""
    rng = np.random.default_rng(5)
    fixed = haar_orthogonal(rng, (20000,), 4)[:, 0, 0]
    plain = haar_orthogonal(rng, (20000,), 4, sign_fix=False)[:, 0, 0]
    se = 1 / np.sqrt(4 * 20000)  # Var(Q_11) = 1/D for Haar
    assert abs(fixed.mean()) < 4 * se
    assert plain.mean() < -10 * se


@pytest.mark.parametrize("num_samples, dim", [(4, 4), (10, 4), (3, 5), (1, 1)])
def test_orthogonal_blocks_are_orthogonal_with_chi_norms(num_samples, dim):
    rng = np.random.default_rng(6)
    omega = draw_omegas(rng, (2,), num_samples, dim, "orthogonal")
    assert omega.shape == (2, num_samples, dim)
    for start in range(0, num_samples, dim):
        block = omega[0, start : start + dim]
        gram = block @ block.T
        assert_close(gram - np.diag(np.diag(gram)), np.zeros_like(gram), atol=1e-12, what="off-diagonal")


def test_orthogonal_norms_are_chi_distributed():
    """Row norms of orthogonal blocks ~ chi_D, independent (Performer sec. 2.4, Yu et al. 2016).

    Kolmogorov-Smirnov against scipy.stats.chi(D) on 30 000 rows; the mean of |w|^2 against D
    with its exact SE sqrt(2D / n) (rows are independent norms, so no widening), its variance
    against 2D; and within a block the norms differ (a fixed-norm coupling, e.g. all rows of
    norm sqrt(D), has the right mean but fails all of these)."""
    from scipy import stats

    rng = np.random.default_rng(7)
    omega = draw_omegas(rng, (5000,), 6, 6, "orthogonal")
    norms = np.linalg.norm(omega, axis=-1)  # (5000, 6): one block of 6 per batch element
    assert stats.kstest(norms.ravel(), stats.chi(6).cdf).pvalue > 1e-4
    sq = (norms**2).ravel()
    assert abs(sq.mean() - 6) < 4.5 * np.sqrt(2 * 6 / sq.size)
    # Var of the sample variance of chi^2_k: (mu_4 - sigma^4) / n = (8 k^2 + 48 k) / n
    assert abs(sq.var() - 2 * 6) < 4.5 * np.sqrt((8 * 6**2 + 48 * 6) / sq.size)
    corr = np.corrcoef(norms[:, 0], norms[:, 1])[0, 1]  # norms of one block are independent
    assert abs(corr) < 4.5 / np.sqrt(norms.shape[0])
    assert norms.std(-1).min() > 0


def test_simplex_directions_have_equal_obtuse_angles():
    for dim in (2, 3, 8):
        s = simplex_directions(dim)
        gram = s @ s.T
        assert_close(np.diag(gram), np.ones(dim), atol=1e-12)
        off = gram[~np.eye(dim, dtype=bool)]
        assert_close(off, np.full(off.shape, -1 / (dim - 1)), atol=1e-12)
    rng = np.random.default_rng(8)
    omega = draw_omegas(rng, (), 5, 5, "simplex")
    unit = omega / np.linalg.norm(omega, axis=-1, keepdims=True)
    off = (unit @ unit.T)[~np.eye(5, dtype=bool)]
    assert_close(off, np.full(off.shape, -0.25), atol=1e-12, what="rotated simplex angles")


def test_smreg_is_strictly_below_softmax_kernel_and_matches_quadrature():
    """SMREG < exp(x.y) (Performer Thm. 1, d >= 2); the Bessel closed form equals direct
    integration over the sphere's first coordinate (density ~ (1 - t^2)^((d-3)/2))."""
    from scipy import integrate, special

    rng = np.random.default_rng(9)
    for dim in (2, 3, 8, 64):
        x = rng.standard_normal((3, dim)) * 0.3
        y = rng.standard_normal((4, dim)) * 0.3
        log_reg = fr.log_smreg(x, y)
        assert (log_reg < x @ y.T).all()
        z = np.linalg.norm(x[1] + y[2])
        kappa = np.sqrt(dim) * z
        if dim == 2:
            mean = special.i0(kappa)
        else:
            density = lambda t: (1 - t * t) ** ((dim - 3) / 2)  # noqa: E731
            norm = integrate.quad(density, -1, 1)[0]
            mean = integrate.quad(lambda t: np.exp(kappa * t) * density(t), -1, 1)[0] / norm
        direct = np.log(mean) - 0.5 * (x[1] @ x[1] + y[2] @ y[2])
        assert_close(log_reg[1, 2], direct, atol=1e-9, what=f"SMREG d={dim}")


def test_oprf_optimal_a_uses_the_mean_over_all_pairs():
    """rho from means and mean squared norms equals the brute-force mean over (i, j) pairs."""
    rng = np.random.default_rng(10)
    x = rng.standard_normal((2, 7, 5))
    y = rng.standard_normal((2, 9, 5)) + 0.3
    rho = (np.linalg.norm(x[:, :, None] + y[:, None], axis=-1) ** 2).mean((1, 2)) / 5
    expected = (1 - 2 * rho - np.sqrt((2 * rho + 1) ** 2 + 8 * rho)) / 16
    assert_close(fr.oprf_optimal_a(x, y), expected, atol=1e-14)
    assert_close(fb.oprf_optimal_a(torch.tensor(x), torch.tensor(y)), expected, atol=1e-14)
    assert (expected <= 0).all()


@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
def test_batched_features_match_reference(feature_map):
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 5, 6))
    omega = rng.standard_normal((2, 7, 6))
    a = np.array([-0.1, -0.3])
    sderf = fr.sderf_optimal_params(x, x + 0.2)
    sderf_t = fb.sderf_optimal_params(torch.tensor(x), torch.tensor(x + 0.2))
    ref, ref_sign = fr.log_features(feature_map, x, omega, oprf_a=a, sderf=sderf)
    bat, bat_sign = fb.log_features(feature_map, torch.tensor(x), torch.tensor(omega), oprf_a=torch.tensor(a), sderf=sderf_t)
    assert_close(bat, ref, atol=1e-12)
    assert (ref_sign is None) == (bat_sign is None)
    if ref_sign is not None:
        assert_close(bat_sign, ref_sign, atol=0)


def test_oprf_rejects_a_at_or_above_a_quarter():
    with pytest.raises(ValueError, match="A < 1/4"):
        fr.oprf_log_features(np.zeros((1, 2)), np.zeros((1, 2)), 0.25)


def test_unknown_coupling_lists_allowed():
    with pytest.raises(ValueError, match="coupling='sobol' is not allowed"):
        draw_omegas(np.random.default_rng(0), (), 4, 4, "sobol")
    assert set(COUPLINGS) >= set(UNBIASED_COUPLINGS)


# ---------------------------------------------------------------------------------------
# SDERF / FAVOR# (Likhosherstov et al. NeurIPS 2023; derivation in fr.sderf_optimal_params)


def _anisotropic_pair(rng, n=6, m=5, dim=3):
    stretch = np.array([1.6, 0.3, 0.8])[:dim]
    return rng.standard_normal((n, dim)) * stretch * 0.5, rng.standard_normal((m, dim)) * stretch * 0.5 + 0.1


def _log_second_moment_brute(a_matrix, x, y):
    """Mean over all (i, j) pairs of log E[f^2 f^2], written out with dense matrices (no eigenbasis)."""
    eye = np.eye(x.shape[-1])
    z = x[:, None] + y[None]
    g = (eye - 4 * a_matrix) @ np.linalg.inv(eye - 8 * a_matrix)
    quad = np.einsum("ijd,de,ije->ij", z, g, z)
    norms = (x * x).sum(-1)[:, None] + (y * y).sum(-1)[None]
    return (np.linalg.slogdet(eye - 4 * a_matrix)[1] - 0.5 * np.linalg.slogdet(eye - 8 * a_matrix)[1]
            + (2 * quad - norms).mean())


def test_sderf_pair_moment_is_the_mean_over_all_pairs():
    x, y = _anisotropic_pair(np.random.default_rng(20))
    z = (x[:, None] + y[None]).reshape(-1, x.shape[-1])
    assert_close(fr.sderf_pair_moment(x, y), z.T @ z / len(z), atol=1e-14)


def test_sderf_features_are_the_dense_exponential_formula():
    """f = det(I-4A)^{1/4} exp(w^T A w + w^T (I-4A)^{1/2} x - |x|^2/2), with scipy's matrix square root."""
    from scipy.linalg import sqrtm

    rng = np.random.default_rng(21)
    x, y = _anisotropic_pair(rng)
    omega = rng.standard_normal((4, 3))
    params = fr.sderf_optimal_params(x, y)
    a_matrix = params.basis @ np.diag(params.lam) @ params.basis.T
    b_matrix = np.real(sqrtm(np.eye(3) - 4 * a_matrix))
    log_d0 = 0.25 * np.linalg.slogdet(np.eye(3) - 4 * a_matrix)[1]
    expected = (log_d0 + np.einsum("sd,de,se->s", omega, a_matrix, omega)[None]
                + x @ (omega @ b_matrix).T - 0.5 * (x * x).sum(-1)[:, None])
    got, sign = fr.sderf_log_features(x, omega, params)
    assert sign is None
    assert_close(got[..., 0], expected, atol=1e-12)


def test_sderf_optimum_beats_every_perturbed_symmetric_a():
    """A* minimizes the mean log second moment: random symmetric perturbations only increase it."""
    rng = np.random.default_rng(22)
    x, y = _anisotropic_pair(rng)
    params = fr.sderf_optimal_params(x, y)
    a_star = params.basis @ np.diag(params.lam) @ params.basis.T
    best = _log_second_moment_brute(a_star, x, y)
    for step in (1e-2, 1e-3):
        for _ in range(20):
            e = rng.standard_normal((3, 3))
            assert _log_second_moment_brute(a_star + step * (e + e.T) / 2, x, y) > best
    # and OPRF's A* I (a member of the family) is no better
    assert _log_second_moment_brute(fr.oprf_optimal_a(x, y) * np.eye(3), x, y) > best


def test_sderf_reduces_to_oprf_for_isotropic_moments():
    """M = rho I (orthonormal-rows data, zero mean) => every eigenvalue of A* is OPRF's A*, features equal."""
    rng = np.random.default_rng(23)
    basis = np.linalg.qr(rng.standard_normal((4, 4)))[0] * 0.7
    x = np.concatenate([basis, -basis])  # mean 0, x^T x / N = 0.49/2 I
    y = x.copy()
    params = fr.sderf_optimal_params(x, y)
    a = fr.oprf_optimal_a(x, y)
    assert_close(params.lam, np.full(4, a), atol=1e-14)
    omega = rng.standard_normal((5, 4))
    assert_close(fr.sderf_log_features(x, omega, params)[0], fr.oprf_log_features(x, omega, a)[0], atol=1e-12)


def test_batched_sderf_params_match_reference_in_float32_and_float64():
    x, y = _anisotropic_pair(np.random.default_rng(24))
    ref = fr.sderf_optimal_params(x, y)
    a_ref = ref.basis @ np.diag(ref.lam) @ ref.basis.T  # eigenvector signs are arbitrary; A is not
    for dtype, tol in ((torch.float64, 1e-13), (torch.float32, 1e-6)):
        bat = fb.sderf_optimal_params(torch.tensor(x, dtype=dtype), torch.tensor(y, dtype=dtype))
        assert bat.lam.dtype == dtype
        a_bat = (bat.basis.double() @ torch.diag_embed(bat.lam.double()) @ bat.basis.double().T).numpy()
        assert_close(a_bat, a_ref, atol=tol)


def test_sderf_rejects_eigenvalues_at_or_above_an_eighth():
    params = fr.SderfParams(np.eye(2), np.array([0.0, 0.125]))
    with pytest.raises(ValueError, match="< 1/8"):
        fr.sderf_log_features(np.zeros((1, 2)), np.zeros((1, 2)), params)
    with pytest.raises(ValueError, match="needs sderf"):
        fr.log_features("sderf", np.zeros((1, 2)), np.zeros((1, 2)))


def test_thin_qr_block_has_the_moments_of_haar_rows():
    """A block of S < D rows from the thin QR (haar_stiefel) has the law of S rows of a Haar matrix, checked by
    the moments of Haar O(D) (Collins & Sniady 2006, low orders written out): E[Q_ij] = 0, E[Q_ij^2] = 1/D,
    E[Q_ij^4] = 3/(D(D+2)), E[Q_11^2 Q_22^2] = (D+1)/((D-1)D(D+2)), E[Q_11 Q_22 Q_12 Q_21] = -1/((D-1)D(D+2));
    each within 4 standard errors of its sample mean (n = 40 000 blocks, D = 5, S = 2). Without the sign fix
    E[Q_11] is far below 0 (the same negative control as the full QR)."""
    from randattn.estimators.sampling import haar_stiefel

    d, n = 5, 40000
    rng = np.random.default_rng(21)
    q = haar_stiefel(rng, (n,), 2, d)  # (n, 2, D)
    assert_close(q @ np.swapaxes(q, -1, -2), np.broadcast_to(np.eye(2), (n, 2, 2)), atol=1e-12, what="orthonormal")
    moments = {
        "E[Q_11]": (q[:, 0, 0], 0.0),
        "E[Q_23]": (q[:, 1, 2], 0.0),
        "E[Q_13^2]": (q[:, 0, 2] ** 2, 1 / d),
        "E[Q_11^4]": (q[:, 0, 0] ** 4, 3 / (d * (d + 2))),
        "E[Q_11^2 Q_22^2]": (q[:, 0, 0] ** 2 * q[:, 1, 1] ** 2, (d + 1) / ((d - 1) * d * (d + 2))),
        "E[Q_11 Q_22 Q_12 Q_21]": (q[:, 0, 0] * q[:, 1, 1] * q[:, 0, 1] * q[:, 1, 0], -1 / ((d - 1) * d * (d + 2))),
    }
    for what, (sample, expected) in moments.items():
        se = sample.std(ddof=1) / np.sqrt(n)
        assert abs(sample.mean() - expected) < 4 * se, (what, sample.mean(), expected, se)
    plain = haar_stiefel(np.random.default_rng(22), (n,), 2, d, sign_fix=False)[:, 0, 0]
    assert plain.mean() < -10 / np.sqrt(d * n)


def test_a_truncated_orthogonal_block_is_drawn_thin():
    """S = 7 at D = 4: one full block and 3 thin-QR rows, orthogonal within each block, every row ~ chi_4 norms."""
    omega = draw_omegas(np.random.default_rng(23), (3,), 7, 4, "orthogonal")
    assert omega.shape == (3, 7, 4)
    for block in (omega[:, :4], omega[:, 4:]):
        gram = block @ np.swapaxes(block, -1, -2)
        off = gram - np.einsum("...ii->...i", gram)[..., None] * np.eye(block.shape[-2])
        assert_close(off, np.zeros_like(off), atol=1e-12, what="off-diagonal")
