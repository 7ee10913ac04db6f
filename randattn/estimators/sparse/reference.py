"""Attention over selected, weighted keys in numpy float64 (the reference form; see the package docstring)."""

from __future__ import annotations

import numpy as np
from scipy.special import logsumexp, softmax

from randattn.estimators.masks import Mask

__all__ = ["attention", "keys_used", "log_denominator", "masked_logits", "repeated", "visible_keys",
           "weighted_attention"]


def visible_keys(num_queries: int, num_keys: int, mask: str | None) -> np.ndarray:
    """``(N, M)`` boolean: the keys each query may see (every key; ``m <= n + M - N`` under the causal mask; the last
    W of those under ``"sliding:W"``: :meth:`~randattn.estimators.masks.Mask.visible`)."""
    visible = Mask.parse(mask).visible(num_queries, num_keys)
    return np.ones((num_queries, num_keys), dtype=bool) if visible is None else visible


def masked_logits(x: np.ndarray, y: np.ndarray, mask: str | None) -> np.ndarray:
    """``x_n . y_m`` : (..., N, M), ``-inf`` where the mask hides key m from query n."""
    logits = x @ np.swapaxes(y, -1, -2)
    if mask is None:
        return logits
    return np.where(visible_keys(x.shape[-2], y.shape[-2], mask), logits, -np.inf)


def weighted_attention(logits: np.ndarray, log_weights: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    r"""``(out, probabilities)``: :math:`\sum_m p_{nm} v_m` with :math:`p_{nm} \propto w_{nm} e^{l_{nm}}`.

    Parameters
    ----------
    logits : (..., N, M)
        :math:`x_n^\top y_m`, ``-inf`` for hidden keys.
    log_weights : (..., N, M)
        :math:`\log w_{nm}`, ``-inf`` for keys left out; broadcast against ``logits``.
    v : (..., M, Dv)

    Every row must keep some visible key (each estimator keeps at least one); the softmax subtracts the
    row maximum of :math:`\log w + l`, so norms above 100 do not overflow.
    """
    return attention(logits + log_weights, v)


def attention(scores: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    r"""``(out, probabilities)`` from the weighted scores :math:`\log w + l` (:func:`weighted_attention`'s sum)."""
    probabilities = softmax(scores, axis=-1)
    return probabilities @ v, probabilities


def keys_used(log_weights: np.ndarray, logits: np.ndarray | None = None) -> np.ndarray:
    """``(..., N)`` float64: the keys each query reads (finite log weight, and visible when ``logits`` is given)."""
    used = np.isfinite(log_weights)
    if logits is not None:
        used = used & np.isfinite(logits)
    return used.sum(axis=-1).astype(np.float64)


def log_denominator(scores: np.ndarray) -> np.ndarray:
    r"""``(..., N)`` float64: :math:`\log \sum_m w_{nm} e^{l_{nm}}` from ``scores`` :math:`= \log w + l`, a logsumexp
    (finite for scores of any size while a row keeps a key)."""
    return logsumexp(scores, axis=-1)


def repeated(array: np.ndarray, replicates: int) -> np.ndarray:
    """``array`` repeated along a new leading replicate dim: the output of a selection made once for every replicate."""
    return np.broadcast_to(array, (replicates, *array.shape)).copy()
