"""Random-feature maps of the softmax kernel ``exp(x·y)``, as log-features.

``reference`` (numpy float64) and ``batched`` (torch) hold the same maps with the same
layout: for inputs ``x : (..., N, D)`` and directions ``omega : (..., S, D)`` a map returns
``(log_magnitude, sign)`` with shape ``(..., N, S, L)`` (L features per direction), where
``sign`` is None for positive maps, so that ``phi = sign * exp(log_magnitude)`` and the
kernel estimate is ``(1/S) sum_{s,l} phi_sl(x) phi_sl(y)``. Which function serves which map
(:func:`select_log_features`, :func:`select_data_params`) is said once here for both forms.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from randattn._validation import check_choice
from randattn.estimators.sampling import sphere_project

FEATURE_MAPS = ("positive", "hyperbolic", "trigonometric", "regularized", "oprf", "sderf")
#: maps whose features are all positive (an SNIS in log space is possible, LARA sec. 3.1)
POSITIVE_MAPS = ("positive", "hyperbolic", "regularized", "oprf", "sderf")
#: maps whose parameters are fitted from the inputs (every query and key: OPRF's A*, SDERF's (A, B)), so that one
#: token's features depend on all the others'; no causal form (a later token would move an earlier output)
DATA_DEPENDENT_MAPS = ("oprf", "sderf")


def select_log_features(forms: ModuleType, feature_map: str, x: Any, omega: Any, *, oprf_a: Any = None,
                        sderf: Any = None) -> tuple[Any, Any]:
    """The log-features of the named map (one of ``FEATURE_MAPS``) from ``forms``, the reference or batched module.

    ``regularized`` is the positive map on directions projected to the sphere of radius sqrt(D);
    ``oprf`` needs ``oprf_a`` and ``sderf`` needs ``sderf`` (the same fitted parameters for queries
    and keys). Only the choice of function is here: the numerics are ``forms``' own.
    """
    check_choice("feature_map", feature_map, FEATURE_MAPS)
    if feature_map == "regularized":
        return forms.positive_log_features(x, sphere_project(omega, omega.shape[-1]))
    if feature_map == "sderf":
        if sderf is None:
            raise ValueError("feature_map='sderf' needs sderf (see sderf_optimal_params)")
        return forms.sderf_log_features(x, omega, sderf)
    if feature_map == "oprf":
        if oprf_a is None:
            raise ValueError("feature_map='oprf' needs oprf_a (see oprf_optimal_a)")
        return forms.oprf_log_features(x, omega, oprf_a)
    return getattr(forms, f"{feature_map}_log_features")(x, omega)


def select_data_params(forms: ModuleType, feature_map: str, x: Any, y: Any) -> dict[str, Any]:
    """The data-dependent parameters of a map as ``log_features`` keywords, fitted by ``forms`` (``{}`` for fixed maps)."""
    if feature_map == "oprf":
        return {"oprf_a": forms.oprf_optimal_a(x, y)}
    if feature_map == "sderf":
        return {"sderf": forms.sderf_optimal_params(x, y)}
    return {}
