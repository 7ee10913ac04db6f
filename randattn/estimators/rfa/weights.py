r"""RFA's self-normalized importance weights, for the IS diagnostics (ARCHITECTURE sec. 4).

.. math::
    \log w_{ns} = \log\xi(x_n, \omega_s) + \operatorname{logsumexp}_m \log\xi(y_m, \omega_s),
    \qquad
    f(\omega_s) = \sum_m \mathrm{softmax}_m\big(\log\xi(y_m, \omega_s)\big)\, v_m,

from the draws' log-features (never N x M). Maps with L > 1 features per sample (hyperbolic) give
``S L`` weights per query. Signed maps (trigonometric) have no importance weights. Reference
(numpy float64) and batched (torch) forms side by side, as the estimator's.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from randattn.estimators._prepare import prepare_batched, prepare_reference, to_torch_draws
from randattn.estimators.features import POSITIVE_MAPS
from randattn.estimators.features.reference import paired_log_features
from randattn.estimators.snis import batched as snis_batched
from randattn.estimators.snis.reference import snis_terms_from_log_features

__all__ = ["rfa_snis_terms", "reference_terms", "batched_terms", "has_weights", "weights_per_sample"]


def has_weights(params: Mapping[str, Any]) -> bool:
    """Positive feature maps have importance weights; signed ones (trigonometric) do not."""
    return params.get("feature_map", "positive") in POSITIVE_MAPS


def weights_per_sample(params: Mapping[str, Any]) -> int:
    """L, the features per sample: 2 for the hyperbolic pair (+omega, -omega), else 1."""
    return 2 if params.get("feature_map") == "hyperbolic" else 1


def rfa_snis_terms(
    q: Any, k: Any, v: Any, omega: Any, *, scale: float | None = None, feature_map: str = "positive"
) -> tuple[np.ndarray, np.ndarray] | None:
    r"""RFA's unnormalized log importance weights and per-sample values.

    Parameters
    ----------
    q : (..., N, D)
    k : (..., M, D)
    v : (..., M, Dv)
    omega : (R, ..., S, D)
        The RFA draws (``draws["omega"]``).
    scale : float, optional
        Temperature, default ``D ** -0.5``.
    feature_map : str
        RFA's feature map; signed maps (``trigonometric``) return None.

    Returns
    -------
    log_w : (R, ..., N, J) ndarray
        :math:`\log\xi(x_n, \omega_j) + \operatorname{logsumexp}_m \log\xi(y_m, \omega_j)`, J = S L.
    f : (R, ..., J, Dv) ndarray
        :math:`\sum_m \mathrm{softmax}_m(\log\xi(y_m, \omega_j)) v_m`.
    or None for signed feature maps.
    """
    if feature_map not in POSITIVE_MAPS:
        return None
    x, y, v, _, _ = prepare_reference(q, k, v, scale)
    omega = np.asarray(omega, dtype=np.float64)
    lx, _, ly, _ = paired_log_features(feature_map, x, omega=omega, y=y)
    return snis_terms_from_log_features(lx, ly, v[None])




def reference_terms(q, k, v, draws, *, scale, params) -> tuple[np.ndarray, np.ndarray] | None:
    """numpy ``(log_w (R, ..., N, J), f (R, ..., J, Dv))``, or None for a signed map."""
    return rfa_snis_terms(q, k, v, draws["omega"], scale=scale, feature_map=params.get("feature_map", "positive"))


def batched_terms(q, k, v, draws, *, scale, params):
    """torch form of :func:`reference_terms`."""
    feature_map = params.get("feature_map", "positive")
    if feature_map not in POSITIVE_MAPS:
        return None
    from randattn.estimators.features.batched import data_params, log_features

    x, y, v, _, _ = prepare_batched(q, k, v, scale)
    omega = to_torch_draws(draws, x)["omega"]
    fitted = {key: (type(val)(*(t.unsqueeze(0) for t in val)) if isinstance(val, tuple) else val.unsqueeze(0))
              for key, val in data_params(feature_map, x, y).items()}  # a leading replicate dim, as rfa.batched
    lx, _ = log_features(feature_map, x.unsqueeze(0), omega, **fitted)
    ly, _ = log_features(feature_map, y.unsqueeze(0), omega, **fitted)
    return snis_batched.snis_terms_from_log_features(lx, ly, v.unsqueeze(0))
