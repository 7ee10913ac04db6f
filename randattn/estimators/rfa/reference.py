"""RFA / Performer in numpy float64 (reference form)."""

from __future__ import annotations

from typing import Any

import numpy as np

from randattn.estimators._prepare import check_draw_array, prepare_reference
from randattn.estimators.base import Draws, keyword_entry
from randattn.estimators.features.reference import paired_log_features
from randattn.estimators.rfa.options import RfaOptions
from randattn.estimators.snis import NonPositiveDenominatorWarning, warn_non_positive
from randattn.estimators.snis.reference import feature_attention

__all__ = ["estimate", "NonPositiveDenominatorWarning"]


@keyword_entry(RfaOptions)
def estimate(q: Any, k: Any, v: Any, draws: Draws, options: RfaOptions) -> np.ndarray:
    r"""RFA (LARA eq. 2), computed as the log-space SNIS of ARCHITECTURE sec. 4.

    .. math::
        \mathrm{RFA}(q_n) = \frac{\sum_s \xi(x_n, \omega_s)^\top \sum_m \xi(y_m, \omega_s) v_m}
                                 {\sum_s \xi(x_n, \omega_s)^\top \sum_m \xi(y_m, \omega_s)},
        \qquad x = \sqrt{s}\, q,\ y = \sqrt{s}\, k.

    Parameters
    ----------
    q, k, v : array_like
        Queries (..., N, D), keys (..., M, D), values (..., M, Dv).
    draws : Draws
        ``omega : (R, ..., S, D)`` from :func:`randattn.estimators.rfa.draw`.
    scale : float, optional
        Temperature; default ``D ** -0.5``.
    feature_map : {"positive", "hyperbolic", "trigonometric", "regularized", "oprf", "sderf"}
        ``oprf`` uses the closed-form ``A*``, ``sderf`` the closed-form ``(A, B)`` of
        :func:`~randattn.estimators.features.reference.sderf_optimal_params`, computed from these inputs.
    coupling : str
        Only used by ``draw``; accepted here so that one parameter set serves both.
    mask : {None, "causal"}
        ``"causal"``: query n sees the keys :math:`m \le n + M - N` only (M >= N; ARCHITECTURE
        sec. 12), the literal masked sum of Performer App. B.1 eq. 11 below
        (:func:`~randattn.estimators.snis.reference.feature_attention` with ``mask="causal"``); the data-dependent
        ``oprf`` and ``sderf`` maps are refused (their parameters are fitted from every token).

    Returns
    -------
    (R, ..., N, Dv)

    Notes
    -----
    Linear in N and M: never forms an N x M matrix and adds no epsilon. The regularized
    map estimates attention under the SMREG kernel (Performer Thm. 1), not softmax.

    Under the causal mask, for query n with last visible key :math:`L_n = n + M - N`,

    .. math::
        \mathrm{RFA}(q_n) = \frac{\sum_s \xi(x_n, \omega_s)^\top \sum_{m \le L_n} \xi(y_m, \omega_s) v_m}
                                 {\sum_s \xi(x_n, \omega_s)^\top \sum_{m \le L_n} \xi(y_m, \omega_s)},

    computed per query as the log-space SNIS over its visible keys (one query at a time,
    O(N M S L Dv); the batched form is the prefix-sum algorithm).
    """
    feature_map = options.feature_map
    x, y, v, _, batch = prepare_reference(q, k, v, options.scale)
    omega = check_draw_array(draws, "omega", batch, (None, x.shape[-1]))
    # data-dependent maps (oprf, sderf): parameters from queries and keys, shared by both sides
    lx, sx, ly, sy = paired_log_features(feature_map, x, y, omega)
    out, sign = feature_attention(lx, ly, v[None], q_sign=sx, k_sign=sy, mask=options.mask)
    if sx is not None:
        warn_non_positive(sign, "signed trigonometric features")
    return out
