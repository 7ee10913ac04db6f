"""Random-feature maps of ``exp(x·y)`` in torch (batched form of ``features.reference``).

Same names, arguments and ``(..., N, S, L)`` log-feature layout as the reference.
"""

from __future__ import annotations

import sys
import math

import torch

from randattn._validation import check_choice
from randattn.estimators.features import POSITIVE_MAPS, select_data_params, select_log_features
from randattn.estimators.features.reference import SderfParams, _optimal_eigenvalue
from randattn.estimators.sampling import sphere_project

__all__ = [
    "positive_log_features",
    "hyperbolic_log_features",
    "trigonometric_log_features",
    "oprf_log_features",
    "oprf_optimal_a",
    "sderf_optimal_params",
    "sderf_log_features",
    "data_params",
    "log_features",
    "affine_directions",
]


def _projections(x: torch.Tensor, omega: torch.Tensor) -> torch.Tensor:
    return x @ omega.transpose(-1, -2)


def _half_sq_norm(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * (x * x).sum(-1, keepdim=True)


def positive_log_features(x: torch.Tensor, omega: torch.Tensor) -> tuple[torch.Tensor, None]:
    """``exp(omega·x - |x|^2/2)`` (Performer eq. 7); see ``features.reference``."""
    return (_projections(x, omega) - _half_sq_norm(x)).unsqueeze(-1), None


def hyperbolic_log_features(x: torch.Tensor, omega: torch.Tensor) -> tuple[torch.Tensor, None]:
    """``2^-1/2 e^{-|x|^2/2} [e^{omega·x}, e^{-omega·x}]`` (Performer Lemma 1)."""
    proj = _projections(x, omega)
    base = -_half_sq_norm(x) - 0.5 * math.log(2.0)
    return torch.stack([base + proj, base - proj], dim=-1), None


def trigonometric_log_features(x: torch.Tensor, omega: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``e^{|x|^2/2} [sin(omega·x), cos(omega·x)]`` as (log|phi|, sign phi)."""
    proj = _projections(x, omega)
    trig = torch.stack([torch.sin(proj), torch.cos(proj)], dim=-1)
    return torch.log(trig.abs()) + _half_sq_norm(x).unsqueeze(-1), torch.sign(trig)


def _violated(condition: torch.Tensor) -> bool:
    """Whether a parameter bound is violated, checked where it costs no device synchronisation (on the CPU).

    The closed forms guarantee the bounds (OPRF: rho >= 0 gives A* <= 0 < 1/4; SDERF: the optimal eigenvalue is
    below 1/8 by construction); the check guards parameters passed in by hand, which the reference and the CPU
    tests exercise. On an accelerator reading the answer back would stall the device on every call.
    """
    return condition.device.type == "cpu" and bool(condition.any())


def oprf_optimal_a(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Closed-form ``A*`` of OPRF / FAVOR++ from mean squared norms and means, ``(...,)``."""
    dim = x.shape[-1]
    rho = ((x * x).sum(-1).mean(-1) + (y * y).sum(-1).mean(-1) + 2.0 * (x.mean(-2) * y.mean(-2)).sum(-1)) / dim
    return (1.0 - 2.0 * rho - torch.sqrt((2.0 * rho + 1.0) ** 2 + 8.0 * rho)) / 16.0


def oprf_log_features(x: torch.Tensor, omega: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, None]:
    """``D0 exp(A|omega|^2 + B omega·x - |x|^2/2)`` (Likhosherstov et al. 2022)."""
    if _violated(a >= 0.25):
        raise ValueError(f"OPRF needs A < 1/4, got max A = {float(a.max())}")
    dim = x.shape[-1]
    a_ = a[..., None, None]
    b = torch.sqrt(1.0 - 4.0 * a_)
    log_d0 = 0.25 * dim * torch.log1p(-4.0 * a_)
    omega_sq = (omega * omega).sum(-1).unsqueeze(-2)
    log_mag = log_d0 + a_ * omega_sq + b * _projections(x, omega) - _half_sq_norm(x)
    return log_mag.unsqueeze(-1), None


def sderf_optimal_params(x: torch.Tensor, y: torch.Tensor) -> SderfParams:
    """Closed-form SDERF parameters from second moments; see ``features.reference.sderf_optimal_params``.

    The (D, D) moment and its eigendecomposition are taken in float64 whatever the input
    dtype (``O((N + M) D^2 + D^3)``, negligible beside the features) and returned in x's dtype.
    """
    x64, y64 = x.double(), y.double()
    mx, my = x64.mean(-2), y64.mean(-2)
    cross = mx.unsqueeze(-1) * my.unsqueeze(-2)
    moment = (x64.transpose(-1, -2) @ x64) / x.shape[-2] + (y64.transpose(-1, -2) @ y64) / y.shape[-2]
    moment = moment + cross + cross.transpose(-1, -2)
    mu, basis = torch.linalg.eigh(moment)
    lam = _optimal_eigenvalue(mu.clamp(min=0.0))
    return SderfParams(basis.to(x.dtype), lam.to(x.dtype))


def sderf_log_features(x: torch.Tensor, omega: torch.Tensor, params: SderfParams) -> tuple[torch.Tensor, None]:
    """``det(I-4A)^{1/4} exp(w^T A w + w^T (I-4A)^{1/2} x - |x|^2/2)``; see ``features.reference``."""
    basis, lam = params
    if _violated(lam >= 0.125):
        raise ValueError(f"SDERF needs every eigenvalue of A < 1/8 (finite variance), got max {float(lam.max())}")
    rotated = omega @ basis
    b_omega = (rotated * torch.sqrt(1.0 - 4.0 * lam).unsqueeze(-2)) @ basis.transpose(-1, -2)
    log_d0 = 0.25 * torch.log1p(-4.0 * lam).sum(-1)[..., None, None]
    quad = ((rotated * rotated) @ lam.unsqueeze(-1)).squeeze(-1).unsqueeze(-2)
    log_mag = log_d0 + quad + _projections(x, b_omega) - _half_sq_norm(x)
    return log_mag.unsqueeze(-1), None


def data_params(feature_map: str, x: torch.Tensor, y: torch.Tensor) -> dict:
    """``log_features`` keywords of the data-dependent maps (oprf, sderf); see ``features.reference``."""
    return select_data_params(sys.modules[__name__], feature_map, x, y)


def log_features(
    feature_map: str,
    x: torch.Tensor,
    omega: torch.Tensor,
    *,
    oprf_a: torch.Tensor | None = None,
    sderf: SderfParams | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Dispatch to the named map (one of ``FEATURE_MAPS``), as ``features.reference.log_features``."""
    return select_log_features(sys.modules[__name__], feature_map, x, omega, oprf_a=oprf_a, sderf=sderf)


def affine_directions(
    feature_map: str, omega: torch.Tensor, *, oprf_a: torch.Tensor | None = None, sderf: SderfParams | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Every positive map as ``log phi_j(x) = x . W_j + a_j - |x|^2/2`` over J = S L features.

    Returns ``W : (..., J, D)`` and ``a : (..., J)`` with the same feature order as
    :func:`log_features` (j = s L + l):

    - positive: :math:`W = \omega`, a = 0; regularized: the same with omega projected to the sphere;
    - hyperbolic: :math:`W_{s,\pm} = \pm\omega_s`, :math:`a = -\tfrac12\log 2`;
    - oprf: :math:`W = \sqrt{1 - 4A}\,\omega`, :math:`a = A|\omega|^2 + \tfrac D4 \log(1 - 4A)`;
    - sderf: :math:`W = (I - 4A)^{1/2}\omega`, :math:`a = \omega^\top A \omega + \tfrac14\log\det(I - 4A)`.

    Lets RFA compute every projection as one matrix product with no (N, S) temporaries for the
    row and column terms (``rfa.batched``); the signed trigonometric map has no such form.
    """
    check_choice("feature_map", feature_map, POSITIVE_MAPS)
    zero = omega.new_zeros(omega.shape[:-1])
    if feature_map == "positive":
        return omega, zero
    if feature_map == "regularized":
        return sphere_project(omega, omega.shape[-1]), zero
    if feature_map == "hyperbolic":
        directions = torch.stack([omega, -omega], dim=-2).reshape(*omega.shape[:-2], 2 * omega.shape[-2], omega.shape[-1])
        return directions, omega.new_full(directions.shape[:-1], -0.5 * math.log(2.0))
    if feature_map == "oprf":
        if oprf_a is None:
            raise ValueError("feature_map='oprf' needs oprf_a (see oprf_optimal_a)")
        if _violated(oprf_a >= 0.25):
            raise ValueError(f"OPRF needs A < 1/4, got max A = {float(oprf_a.max())}")
        a_ = oprf_a[..., None]
        offset = a_ * (omega * omega).sum(-1) + 0.25 * omega.shape[-1] * torch.log1p(-4.0 * a_)
        return torch.sqrt(1.0 - 4.0 * a_).unsqueeze(-1) * omega, offset
    if sderf is None:
        raise ValueError("feature_map='sderf' needs sderf (see sderf_optimal_params)")
    basis, lam = sderf
    if _violated(lam >= 0.125):
        raise ValueError(f"SDERF needs every eigenvalue of A < 1/8 (finite variance), got max {float(lam.max())}")
    rotated = omega @ basis
    directions = (rotated * torch.sqrt(1.0 - 4.0 * lam).unsqueeze(-2)) @ basis.transpose(-1, -2)
    offset = ((rotated * rotated) @ lam.unsqueeze(-1)).squeeze(-1) + 0.25 * torch.log1p(-4.0 * lam).sum(-1, keepdim=True)
    return directions, offset
