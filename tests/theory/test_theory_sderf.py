"""SDERF / FAVOR# checks of ``randattn verify``: they pass, and each fails on a broken implementation."""

from __future__ import annotations

import numpy as np
import pytest

from randattn import theory
from randattn.theory import _sderf
from randattn.theory._base import HeadData, VerifyData
from randattn.estimators.features import reference as fr

NAMES = ("sderf.unbiased", "sderf.variance-closed-form", "sderf.scalar-a-reduction", "sderf.optimal-a")


def _run(func, name, data=None, **broken):
    return func(theory.check_rng(0, name), True, data, **broken)


def _vit_like_data() -> VerifyData:
    """Two heads with ViT-like anisotropy and norms (keys up to ~100 before scaling), D = 64."""
    rng = np.random.default_rng(5)
    spread = np.geomspace(0.2, 4.0, 64)
    heads = tuple(
        HeadData(rng.standard_normal((16, 64)) * spread, rng.standard_normal((16, 64)) * spread + 1.0,
                 rng.standard_normal((16, 64)), 64**-0.5, f"head {h}")
        for h in range(2)
    )
    return VerifyData(heads, "synthetic ViT-like heads")


def test_sderf_checks_are_registered_and_pass():
    checks = theory.select_checks(theory.registry(), "sderf")
    assert tuple(c.name for c in checks) == NAMES
    for result in theory.run_checks(checks, seed=0, quick=True):
        assert result.passed, (result.name, result.details)


@pytest.mark.parametrize("func, name", [(_sderf.sderf_oprf_reduction, "sderf.scalar-a-reduction"),
                                        (_sderf.sderf_optimal_a_minimizes, "sderf.optimal-a")])
def test_data_checks_pass_on_vit_like_heads(func, name):
    result = _run(func, name, _vit_like_data())
    assert result.passed, result.details
    assert "head" in result.details or "user data" in result.details


def test_unbiased_check_fails_without_the_normalizer_d0():
    def no_d0(x, omega, params):
        log_mag, sign = fr.sderf_log_features(x, omega, params)
        return log_mag - 0.25 * np.log1p(-4 * params.lam).sum(-1), sign

    assert not _run(_sderf.sderf_unbiased, "sderf.unbiased", feature_fn=no_d0).passed


def _features_with_b(b_of_lam):
    """Dense-exponential features with B = Q diag(b_of_lam(lam)) Q^T, written out by hand."""
    def features(x, omega, params):
        a_matrix = params.basis @ np.diag(params.lam) @ params.basis.T
        b_matrix = params.basis @ np.diag(b_of_lam(params.lam)) @ params.basis.T
        quad = np.einsum("...sd,de,...se->...s", omega, a_matrix, omega)[..., None, :]
        log_mag = (0.25 * np.log1p(-4 * params.lam).sum() + quad + x @ np.swapaxes(omega @ b_matrix, -1, -2)
                   - 0.5 * (x * x).sum(-1)[:, None])
        return log_mag[..., None], None
    return features


def test_the_hand_written_features_agree_when_b_is_right():
    """The negative controls below differ from the implementation only in B."""
    rng = np.random.default_rng(1)
    x, omega = rng.standard_normal((3, 4)) * 0.3, rng.standard_normal((2, 5, 4))
    params = fr.sderf_optimal_params(x, x + 0.1)
    right = _features_with_b(lambda lam: np.sqrt(1 - 4 * lam))(x, omega, params)[0]
    np.testing.assert_allclose(right, fr.sderf_log_features(x, omega, params)[0], atol=1e-12)


def test_unbiased_check_fails_with_b_equal_identity():
    """B = I instead of (I - 4A)^{1/2}: the constraint B'(I-4A)^-1 B = I is broken."""
    broken = _features_with_b(lambda lam: np.ones_like(lam))
    assert not _run(_sderf.sderf_unbiased, "sderf.unbiased", feature_fn=broken).passed


def test_variance_check_fails_with_a_missing_determinant():
    def missing(x, y, params):
        return fr.sderf_variance(x, y, params) * np.prod(1 - 8 * params.lam) ** 0.5

    assert not _run(_sderf.sderf_variance_closed_form, "sderf.variance-closed-form", variance_fn=missing).passed


def test_reduction_check_fails_with_a_wrong_eigenvalue_formula_or_features():
    def halved(x, y):
        p = fr.sderf_optimal_params(x, y)
        return fr.SderfParams(p.basis, 0.5 * p.lam)

    assert not _run(_sderf.sderf_oprf_reduction, "sderf.scalar-a-reduction", params_fn=halved).passed

    first_order = _features_with_b(lambda lam: 1 - 2 * lam)  # sqrt(1 - 4 lam) to first order
    assert not _run(_sderf.sderf_oprf_reduction, "sderf.scalar-a-reduction", feature_fn=first_order).passed


def test_optimal_a_check_fails_for_oprf_scalar_a():
    """OPRF's A* I is in the family but not optimal for anisotropic moments: the check must see the excess."""
    def oprf_as_sderf(x, y):
        return fr.SderfParams(np.eye(x.shape[-1]), np.full(x.shape[-1], float(fr.oprf_optimal_a(x, y))))

    assert not _run(_sderf.sderf_optimal_a_minimizes, "sderf.optimal-a", params_fn=oprf_as_sderf).passed
