"""Random-feature maps of ``exp(x·y)`` in torch (batched form of ``features.reference``).

Same names, arguments and ``(..., N, S, L)`` log-feature layout as the reference.
"""

from __future__ import annotations

import math

import torch

from randattn._validation import check_choice
from randattn.estimators.features import FEATURE_MAPS
from randattn.estimators.sampling import sphere_project

__all__ = [
    "positive_log_features",
    "hyperbolic_log_features",
    "trigonometric_log_features",
    "oprf_log_features",
    "oprf_optimal_a",
    "log_features",
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


def oprf_optimal_a(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Closed-form ``A*`` of OPRF / FAVOR++ from mean squared norms and means, ``(...,)``."""
    dim = x.shape[-1]
    rho = ((x * x).sum(-1).mean(-1) + (y * y).sum(-1).mean(-1) + 2.0 * (x.mean(-2) * y.mean(-2)).sum(-1)) / dim
    return (1.0 - 2.0 * rho - torch.sqrt((2.0 * rho + 1.0) ** 2 + 8.0 * rho)) / 16.0


def oprf_log_features(x: torch.Tensor, omega: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, None]:
    """``D0 exp(A|omega|^2 + B omega·x - |x|^2/2)`` (Likhosherstov et al. 2022)."""
    if bool((a >= 0.25).any()):
        raise ValueError(f"OPRF needs A < 1/4, got max A = {float(a.max())}")
    dim = x.shape[-1]
    a_ = a[..., None, None]
    b = torch.sqrt(1.0 - 4.0 * a_)
    log_d0 = 0.25 * dim * torch.log1p(-4.0 * a_)
    omega_sq = (omega * omega).sum(-1).unsqueeze(-2)
    log_mag = log_d0 + a_ * omega_sq + b * _projections(x, omega) - _half_sq_norm(x)
    return log_mag.unsqueeze(-1), None


def log_features(
    feature_map: str, x: torch.Tensor, omega: torch.Tensor, *, oprf_a: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Dispatch to the named map (one of ``FEATURE_MAPS``), as ``features.reference.log_features``."""
    check_choice("feature_map", feature_map, FEATURE_MAPS)
    if feature_map == "positive":
        return positive_log_features(x, omega)
    if feature_map == "hyperbolic":
        return hyperbolic_log_features(x, omega)
    if feature_map == "trigonometric":
        return trigonometric_log_features(x, omega)
    if feature_map == "regularized":
        return positive_log_features(x, sphere_project(omega, omega.shape[-1]))
    if oprf_a is None:
        raise ValueError("feature_map='oprf' needs oprf_a (see oprf_optimal_a)")
    return oprf_log_features(x, omega, oprf_a)
