"""Exact softmax attention in numpy float64 (reference form)."""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy.special import softmax

from randattn.estimators._prepare import prepare_reference
from randattn.estimators.base import Draws

__all__ = ["attention_probabilities", "estimate"]


def attention_probabilities(q: Any, k: Any, *, scale: float | None = None) -> np.ndarray:
    r"""``softmax_m(scale q_n·k_m)`` : (..., N, M), max-subtracted (scipy.special.softmax)."""
    dummy_v = np.zeros((*np.shape(k)[:-1], 1))
    x, y, _, _, _ = prepare_reference(q, k, dummy_v, scale)
    return softmax(x @ np.swapaxes(y, -1, -2), axis=-1)


def estimate(q: Any, k: Any, v: Any, draws: Draws | None = None, *, scale: float | None = None) -> np.ndarray:
    r"""Softmax attention (LARA sec. 2.1).

    .. math:: y_n = \sum_m \frac{\exp(s\, q_n^\top k_m)}{\sum_{m'} \exp(s\, q_n^\top k_{m'})} v_m.

    Parameters
    ----------
    q : (..., N, D)
    k : (..., M, D)
    v : (..., M, Dv)
    draws : Draws, optional
        Only its replicate count R is used (softmax is deterministic).
    scale : float, optional
        Temperature s; default ``D ** -0.5``.

    Returns
    -------
    (R, ..., N, Dv) with draws, else (..., N, Dv).
    """
    x, y, v, _, _ = prepare_reference(q, k, v, scale)
    out = softmax(x @ np.swapaxes(y, -1, -2), axis=-1) @ v
    if draws is None:
        return out
    return np.broadcast_to(out, (draws.replicates, *out.shape)).copy()
