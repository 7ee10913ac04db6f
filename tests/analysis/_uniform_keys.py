r"""A plugin-style estimator whose ``draw`` needs more of numpy's ``Generator`` than the sweep's stacked grid offers:
self-normalised importance sampling of the keys with the uniform proposal,

.. math::
    \hat y_n = \frac{\sum_{s} e^{\tau q_n \cdot k_{i_s}} v_{i_s}}{\sum_{s} e^{\tau q_n \cdot k_{i_s}}},
    \qquad i_1, \dots, i_S \overset{iid}{\sim} \mathrm{Uniform}\{0, \dots, M - 1\},

the key indices drawn with ``rng.integers`` (shared by the queries of one batch element), as the plugin guide's
uniform-key example does. Declared as a plugin would declare it, with ``EstimatorSpec`` (so ``stacked_draw`` is
False); the tests register it for their own session only (``register_estimator``).
"""

from __future__ import annotations

import numpy as np
import torch

from randattn.estimators.base import BatchedForms, Draws, EstimatorSpec

NAME = "uniform-keys"


def draw(q_shape, k_shape, *, num_samples, replicates=1, rng) -> Draws:
    """``idx (R, ..., S)``: S key indices per replicate and batch element, as float64."""
    idx = rng.integers(0, k_shape[-2], size=(replicates, *q_shape[:-2], num_samples))
    return Draws({"idx": idx.astype(np.float64)}, replicates)


def reference(q, k, v, draws, *, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    idx = np.asarray(draws["idx"]).astype(int)[..., None]  # (R, ..., S, 1)
    keys = np.take_along_axis(np.broadcast_to(k, (idx.shape[0], *k.shape)), idx, -2)  # (R, ..., S, D)
    values = np.take_along_axis(np.broadcast_to(v, (idx.shape[0], *v.shape)), idx, -2)  # (R, ..., S, Dv)
    logits = scale * np.einsum("...nd,r...sd->r...ns", q, keys)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    return (weights / weights.sum(-1, keepdims=True)) @ values


def batched(q, k, v, draws, *, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    idx = draws["idx"].long()  # (R, ..., S)
    replicates = idx.shape[0]
    keys = torch.gather(k.expand(replicates, *k.shape), -2, idx[..., None].expand(*idx.shape, k.shape[-1]))
    values = torch.gather(v.expand(replicates, *v.shape), -2, idx[..., None].expand(*idx.shape, v.shape[-1]))
    return torch.softmax(scale * q @ keys.transpose(-1, -2), -1) @ values


SPEC = EstimatorSpec(
    name=NAME,
    summary="uniform-proposal SNIS over the keys (test plugin; its draw uses rng.integers)",
    source="tests",
    complexity="O(N S (D + Dv))",
    params={},
    draw=draw,
    reference=reference,
    forms=BatchedForms(estimate=batched),
    convergence="consistent",
    normalized=True,
    cost="linear",
)
