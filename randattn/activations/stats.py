"""Per-layer summaries of captured activations: query/key norms and attention entropy."""

from __future__ import annotations

import numpy as np

from randattn.activations.io import Activations

__all__ = ["attention_entropy", "layer_stats"]


def attention_entropy(q: np.ndarray, k: np.ndarray, scale: float) -> np.ndarray:
    """Entropy (nats) of each row of ``softmax(scale * q k^T)``, computed in float64.

    Parameters
    ----------
    q : ndarray, shape (..., N, D)
    k : ndarray, shape (..., M, D)
    scale : float
        Positive temperature.

    Returns
    -------
    ndarray, shape (..., N)
        In ``[0, log M]``.

    Notes
    -----
    With logits :math:`l_m` and :math:`p = \\mathrm{softmax}(l)`,
    :math:`H = \\operatorname{logsumexp}(l) - \\sum_m p_m l_m`, which never takes the log of an underflowed 0.
    """
    q, k = np.asarray(q, dtype=np.float64), np.asarray(k, dtype=np.float64)
    if q.ndim < 2 or k.ndim < 2 or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q (..., N, D) and k (..., M, D) must share D, got shapes {q.shape} and {k.shape}")
    if not (np.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be positive and finite, got {scale!r}")
    logits = scale * (q @ np.swapaxes(k, -1, -2))
    top = logits.max(axis=-1, keepdims=True)
    weights = np.exp(logits - top)
    total = weights.sum(axis=-1, keepdims=True)
    log_z = np.log(total) + top
    return (log_z - (weights / total * logits).sum(axis=-1, keepdims=True))[..., 0]


def layer_stats(acts: Activations):
    """One row per layer: mean/max raw query and key norms and the mean attention entropy.

    Parameters
    ----------
    acts : Activations
        ``(B, H, N, D)`` per layer.

    Returns
    -------
    pandas.DataFrame
        Columns ``layer, q_norm_mean, q_norm_max, k_norm_mean, k_norm_max, entropy_mean`` (nats; averaged over
        images, heads and query tokens) and ``entropy_max_possible`` (``log N``).
    """
    import pandas as pd

    if not isinstance(acts, Activations):
        raise TypeError(f"acts must be an Activations, got {type(acts).__name__}")
    rows = []
    for layer in acts.layers:
        q, k, _ = (np.asarray(a, dtype=np.float64) for a in acts.qkv(layer))
        q_norm, k_norm = np.linalg.norm(q, axis=-1), np.linalg.norm(k, axis=-1)
        rows.append(
            {
                "layer": layer,
                "q_norm_mean": float(q_norm.mean()),
                "q_norm_max": float(q_norm.max()),
                "k_norm_mean": float(k_norm.mean()),
                "k_norm_max": float(k_norm.max()),
                "entropy_mean": float(attention_entropy(q, k, acts.scale).mean()),
                "entropy_max_possible": float(np.log(k.shape[-2])),
            }
        )
    return pd.DataFrame(rows)
