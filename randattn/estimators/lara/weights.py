"""LARA's self-normalized importance weights, for the IS diagnostics.

The weights of eq. 28, ``alpha'_nc xi(x_n, w_c) sum_m xi(y_m, w_c)``, one sample per proposal, when
they are all positive (balance, coupled, constant or clamped weighting). Signed decoupled weights
(eq. 38) make the SNIS a signed ratio for which Kish's ESS, the delta method and k-hat are not
defined. Reference (numpy float64) and batched (torch) forms side by side, as the estimator's.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from randattn.estimators.lara import batched as lara_batched
from randattn.estimators.lara import reference as lara_reference
from randattn.estimators.snis import batched as snis_batched
from randattn.estimators.snis.reference import snis_terms_from_log_features

__all__ = ["reference_terms", "reference_terms_per_element", "batched_terms", "signed_weights"]


def signed_weights(params: Mapping[str, Any]) -> bool:
    """LARA's decoupled and coupled weights (eq. 38, 37) without ``alpha_clamp`` can be negative.

    In float32 their cancelling sums lose digits that are not small against the MSE being measured
    (up to 2e-2 absolute on DINOv2 layer 3), so the sweep runs them in float64 under ``--dtype auto``.
    """
    return lara_reference.has_signed_weights(params.get("weighting", "decoupled"), params.get("alpha_clamp"))


def reference_terms(q, k, v, draws, *, scale, params) -> tuple[np.ndarray, np.ndarray] | None:
    """LARA's weights alpha'_nc xi(x_n, w_c) sum_m xi(y_m, w_c) (eq. 28), when all are positive.

    Signed weights (decoupled, eq. 38) make the SNIS a signed ratio for which Kish's ESS,
    the delta method and k-hat are not defined: those calls report NaN.
    """
    terms = lara_reference.lara_terms(q, k, v, draws, scale=scale, **params)
    log_qf, log_kf, q_sign = lara_reference.weighted_log_features(terms)
    if q_sign is not None and bool((q_sign <= 0).any()):
        return None
    return snis_terms_from_log_features(log_qf, log_kf, terms.v[None])


def reference_terms_per_element(q, k, v, draws, *, scale, params):
    """numpy LARA terms with NaN log weights for each (replicate, batch element) holding a non-positive weight."""
    terms = lara_reference.lara_terms(q, k, v, draws, scale=scale, **params)
    if terms.alpha_sign is not None and bool((terms.alpha_sign <= 0).reshape(*terms.alpha_sign.shape[:-2], -1)
                                             .any(-1).all()):
        return None  # every (replicate, batch element) holds a non-positive weight: nothing is defined
    log_qf, log_kf, q_sign = lara_reference.weighted_log_features(terms)
    log_w, f = snis_terms_from_log_features(log_qf, log_kf, terms.v[None])
    if q_sign is not None:
        signed = (q_sign <= 0).reshape(*q_sign.shape[:-3], -1).any(-1)
        log_w = np.where(signed[..., None, None], np.nan, log_w)
    return log_w, f


def batched_terms(q, k, v, draws, *, scale, params):
    """torch form of :func:`reference_terms_per_element`."""
    terms = lara_batched.lara_terms(q, k, v, draws, scale=scale, **params)
    if terms.alpha_sign is not None and bool((terms.alpha_sign <= 0).flatten(start_dim=-2).any(-1).all()):
        return None  # every (replicate, batch element) holds a non-positive weight: nothing is defined
    log_qf, log_kf, q_sign = lara_batched.weighted_log_features(terms)
    log_w, f = snis_batched.snis_terms_from_log_features(log_qf, log_kf, terms.v.unsqueeze(0))
    if q_sign is not None:
        # signed weights: undefined for the (replicate, batch element) holding a non-positive one
        signed = (q_sign <= 0).flatten(start_dim=-3).any(-1)  # (R, ...)
        log_w = log_w.masked_fill_(signed[..., None, None], float("nan"))  # in place: log_w is a fresh sum
    return log_w, f
