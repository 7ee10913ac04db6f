r"""A tiny decode-time estimator for the sweep's tests: each query reads its last visible key and each other visible
key independently with probability min(1, S / V_n) (V_n: the keys it sees), and attends over them
(self-normalised), so the number of keys it reads is random. It declares ``keys_used`` and, with ``eps > 0``, the
promise ``(eps, delta)`` -- on the output, or with ``on="denominator"`` on its Horvitz-Thompson estimate of the softmax
normaliser, :math:`\hat Z_n = \sum_{m\ \text{read}} e^{s_{nm}} / \pi_{nm}` (:math:`\pi` = 1 for the last visible
key, else min(1, S / V_n)), given as ``log_denominator`` -- so that the sweep's keys-used and promise columns can be
tested without the real decode-time estimators. Registered by the tests for their own session only
(``register_estimator``).
"""

from __future__ import annotations

import numpy as np
import torch

from randattn.estimators.base import BatchedForms, Draws, EstimatorSpec, Param
from randattn.estimators.masks import causal_visible

NAME = "sampled-keys"


def draw(q_shape, k_shape, *, num_samples=None, replicates=1, rng=None, mask=None, eps=0.0, delta=0.1,
         on="output") -> Draws:
    """``u (R, ..., N, M)`` uniform scores (key m is read when u < S / V_n) and ``budget (R, ..., N)`` holding S (the
    estimate is not passed S otherwise)."""
    rng = np.random.default_rng(rng) if not hasattr(rng, "random") else rng
    u = rng.random((replicates, *q_shape[:-1], k_shape[-2]))
    budget = np.full((replicates, *q_shape[:-1]), float(num_samples))
    return Draws({"u": u, "budget": budget}, replicates)


def _kept_numpy(num_queries: int, num_keys: int, draws, mask) -> np.ndarray:
    visible, last = _visible(num_queries, num_keys, mask), _last(num_queries, num_keys, mask)
    rate = np.asarray(draws["budget"])[..., None] / visible.sum(-1, keepdims=True)
    return ((np.asarray(draws["u"]) < rate) | last) & visible


def reference(q, k, v, draws, *, scale, mask=None, eps=0.0, delta=0.1, on="output"):
    from scipy.special import softmax

    logits = scale * (np.asarray(q) @ np.swapaxes(np.asarray(k), -1, -2))
    kept = _kept_numpy(q.shape[-2], k.shape[-2], draws, mask)
    return softmax(np.where(kept, logits, -np.inf), axis=-1) @ np.asarray(v)


def _kept_torch(q, k, draws, mask):
    n, m = q.shape[-2], k.shape[-2]
    visible = torch.as_tensor(_visible(n, m, mask), device=q.device)
    last = torch.as_tensor(_last(n, m, mask), device=q.device)
    rate = draws["budget"].to(torch.float64)[..., None] / visible.sum(-1, keepdim=True)
    return ((draws["u"].to(torch.float64) < rate) | last) & visible


def _visible(n, m, mask):
    return causal_visible(n, m) if mask == "causal" else np.ones((n, m), bool)


def _last(n, m, mask):
    """(N, M): each query's last visible key."""
    last_key = np.arange(n) + m - n if mask == "causal" else np.full(n, m - 1)
    return np.arange(m)[None, :] == last_key[:, None]


def batched(q, k, v, draws, *, scale, mask=None, eps=0.0, delta=0.1, on="output"):
    logits = scale * (q @ k.transpose(-1, -2))
    kept = _kept_torch(q, k, draws, mask)
    return torch.softmax(logits.masked_fill(~kept, float("-inf")), dim=-1) @ v


def keys_used(q, k, draws, *, scale, mask=None, eps=0.0, delta=0.1, on="output"):
    return _kept_torch(q, k, draws, mask).sum(-1).to(torch.float64)


def log_denominator(q, k, draws, *, scale, mask=None, eps=0.0, delta=0.1, on="output"):
    """``log sum_{m read} e^{s_nm} / pi_nm`` (module docstring), in float64."""
    n, m = q.shape[-2], k.shape[-2]
    visible = torch.as_tensor(_visible(n, m, mask), device=q.device)
    last = torch.as_tensor(_last(n, m, mask), device=q.device)
    rate = (draws["budget"].to(torch.float64)[..., None] / visible.sum(-1, keepdim=True)).clamp(max=1.0)
    log_inclusion = torch.where(last, torch.zeros_like(rate), rate.log())
    logits = (scale * (q @ k.transpose(-1, -2))).to(torch.float64)
    kept = _kept_torch(q, k, draws, mask)
    return torch.logsumexp((logits - log_inclusion).masked_fill(~kept, float("-inf")), dim=-1)


SPEC = EstimatorSpec(
    name=NAME,
    summary="attention over S visible keys sampled uniformly without replacement (a test estimator)",
    source="tests",
    complexity="O(N M)",
    params={"eps": Param(0.0, "promised epsilon; 0: no promise", kind=float),
            "delta": Param(0.1, "promised delta", kind=float),
            "on": Param("output", "what the promise bounds", choices=("output", "denominator"))},
    draw=draw,
    reference=reference,
    forms=BatchedForms(estimate=batched),
    masks=(None, "causal"),
    normalized=True,
    keys_used=keys_used,
    promise=lambda params: (params["eps"], params["delta"]) if params["eps"] > 0 else None,
    promise_on=lambda params: params["on"],
    log_denominator=log_denominator,
)
