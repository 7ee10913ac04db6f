"""Exact softmax attention in numpy float64 (reference form)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.special import softmax

from randattn.estimators._prepare import prepare_reference
from randattn.estimators.base import Draws, EstimatorOptions, keyword_entry
from randattn.estimators.masks import DECLARABLE_MASKS, Mask, check_mask_argument

__all__ = ["attention_probabilities", "estimate", "SoftmaxOptions"]



@dataclass(frozen=True, kw_only=True)
class SoftmaxOptions(EstimatorOptions):
    """Softmax attention's keyword options: no parameters, only ``scale`` and ``mask`` (checked on construction)."""

    mask: str | None = None

    def check(self) -> None:
        check_mask_argument(self.mask, DECLARABLE_MASKS)


def _masked_logits(x: np.ndarray, y: np.ndarray, mask: str | None) -> np.ndarray:
    r"""``x_n·y_m`` : (..., N, M), with -inf where ``mask`` hides key m from query n (``"causal"``: m > n + M - N;
    ``"sliding:W"`` also m <= n + M - N - W; :meth:`~randattn.estimators.masks.Mask.visible`).

    Every row keeps at least its own key n + M - N (M >= N is enforced), so the max-subtracted softmax has no empty
    row.
    """
    logits = x @ np.swapaxes(y, -1, -2)
    visible = Mask.parse(mask).visible(x.shape[-2], y.shape[-2])
    return logits if visible is None else np.where(visible, logits, -np.inf)


def attention_probabilities(q: Any, k: Any, *, scale: float | None = None, mask: str | None = None) -> np.ndarray:
    r"""``softmax_m(scale q_n·k_m)`` : (..., N, M), max-subtracted (scipy.special.softmax).

    ``mask="causal"`` or ``"sliding:W"``: over the visible keys only, exactly 0 at the others.
    """
    check_mask_argument(mask, DECLARABLE_MASKS)
    dummy_v = np.zeros((*np.shape(k)[:-1], 1))
    x, y, _, _, _ = prepare_reference(q, k, dummy_v, scale)
    return softmax(_masked_logits(x, y, mask), axis=-1)


@keyword_entry(SoftmaxOptions)
def estimate(q: Any, k: Any, v: Any, draws: Draws | None = None, *, options: SoftmaxOptions) -> np.ndarray:
    r"""Softmax attention (LARA sec. 2.1).

    .. math:: y_n = \sum_{m \in V_n} \frac{\exp(s\, q_n^\top k_m)}{\sum_{m' \in V_n} \exp(s\, q_n^\top k_{m'})} v_m,

    with :math:`V_n` every key, under ``mask="causal"`` the keys :math:`m \le n + M - N`, and under
    ``mask="sliding:W"`` the last W of those, :math:`n + M - N - W < m \le n + M - N` (ARCHITECTURE sec. 12; the
    hidden logits are set to -inf before the max-subtracted softmax).

    Parameters
    ----------
    q, k, v : array_like
        Queries (..., N, D), keys (..., M, D), values (..., M, Dv).
    draws : Draws, optional
        Only its replicate count R is used (softmax is deterministic).
    scale : float, optional
        Temperature s; default ``D ** -0.5``.
    mask : {None, "causal", "sliding:W"}
        A mask requires M >= N (the queries are the last N of the M tokens).

    Returns
    -------
    (R, ..., N, Dv) with draws, else (..., N, Dv).
    """
    x, y, v, _, _ = prepare_reference(q, k, v, options.scale)
    if options.mask is None:
        out = softmax(x @ np.swapaxes(y, -1, -2), axis=-1) @ v
    else:
        out = softmax(_masked_logits(x, y, options.mask), axis=-1) @ v
    if draws is None:
        return out
    return np.broadcast_to(out, (draws.replicates, *out.shape)).copy()
