"""Checks that grow their inputs where a configuration is exact softmax on them, and the unbiasedness test's
rounding floor.

A decode-time estimator keeps a window of recent keys exact and samples the rest; at its default window the
checks' small inputs (10 keys for the masks, 9 and 20 for keys used, 12 for the query blocks and exact limits, 7
for unbiasedness) held no key to sample, and estimators that read future keys, miscount their keys, pool the
queries or carry a bias passed every check. The window sampler below is written out here (torch, float64 numpy for
the reference): for query n, with visible keys ``lo..hi`` (``hi = n + M - N``), the last ``window`` of them exact
and S uniform draws (with replacement) from the rest, each weighted ``c / S`` for c residual keys.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

import randattn
from randattn.estimators.base import BatchedForms, Draws, EstimatorSpec, ExactLimit, Param
from randattn.testing import check_estimator

GROWING = ["causal prefix invariance", "sliding window", "keys used", "exact limits", "query blocks",
           "declared convergence"]


def _ranges(n: int, m: int, mask):
    """(lo, hi): the first and last key each query sees, (N,) int64 tensors."""
    hi = torch.arange(n) + (m - n if mask is not None else 0)
    if mask is None:
        return torch.zeros(n, dtype=torch.int64), torch.full((n,), m - 1)
    window = int(mask.partition(":")[2]) if mask.startswith("sliding:") else m
    return torch.clamp(hi - window + 1, min=0), hi


def _weights(q, k, draws, *, mask, window, defect=""):
    """``(R, ..., N, M)``: each key's weight (1 exact, c/S per draw, 0 unread), float64."""
    n, m = q.shape[-2], k.shape[-2]
    lo, hi = _ranges(n, m, mask)
    u = draws["u"].to(torch.float64)
    samples = u.shape[-1]
    first_exact = torch.maximum(lo, hi - window + 1)  # (N,)
    count = (first_exact - lo)[:, None]  # residual keys
    keys = torch.arange(m)
    w = ((keys >= first_exact[:, None]) & (keys <= hi[:, None])).to(torch.float64)
    w = w.expand(*u.shape[:-1], m).clone()
    index = lo[:, None] + torch.minimum(torch.floor(u * count).to(torch.int64), torch.clamp(count - 1, min=0))
    if defect == "future" and mask is not None:  # sampled keys shifted past the window: future keys under a mask
        index = torch.clamp(index + window + 2, max=m - 1)
    share = (count.to(torch.float64) / samples).expand(index.shape) * (count > 0)
    if defect == "pooled":  # the sampled keys' weight from the mean of every query present
        share = share * torch.exp(0.3 * torch.tanh(torch.linalg.vector_norm(q.mean(-2), dim=-1)))[..., None, None]
    if defect == "heavy":  # the sampled keys weigh half again too much: a bias that needs a residual to show
        share = share * 1.5
    return w.scatter_add(-1, index, share)


def _estimate(q, k, v, draws, *, scale=None, mask=None, window=16, defect="", unnormalized=False):
    q, k, v = (torch.as_tensor(a) for a in (q, k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = scale * q @ k.transpose(-1, -2)
    w = _weights(q, k, draws, mask=mask, window=window, defect=defect)
    if unnormalized:  # Horvitz-Thompson over the exact normaliser of the visible keys
        lo, hi = _ranges(q.shape[-2], k.shape[-2], mask)
        keys = torch.arange(k.shape[-2])
        visible = (keys >= lo[:, None]) & (keys <= hi[:, None])
        log_z = torch.logsumexp(logits.masked_fill(~visible, -torch.inf), -1, keepdim=True)
        return (w * torch.exp(logits.masked_fill(w == 0, -torch.inf) - log_z)) @ v
    logits = logits.masked_fill(w == 0, -torch.inf)  # the keys it does not read, hidden ones among them, play no part
    p = w * torch.exp(logits - logits.amax(-1, keepdim=True))
    return (p / p.sum(-1, keepdim=True)) @ v


def _draw(q_shape, k_shape, *, num_samples, replicates=1, rng=None, mask=None, window=16, **_):
    return Draws({"u": rng.random((replicates, *q_shape[:-1], num_samples))}, replicates)


def _sampler(defect: str = "", *, unbiased: bool = False, limit=None, **facts) -> EstimatorSpec:
    """The window sampler with ``defect`` planted ("future", "counts-draws", "pooled", "heavy"); ``unbiased``: the
    Horvitz-Thompson form, declared unbiased."""

    def batched(q, k, v, draws, **params):
        return _estimate(q, k, v, draws, defect=defect, unnormalized=unbiased, **params)

    def reference(q, k, v, draws, **params):
        t = lambda a: torch.as_tensor(np.asarray(a, dtype=np.float64))  # noqa: E731
        return _estimate(t(q), t(k), t(v), Draws({"u": t(draws["u"])}, draws.replicates), defect=defect,
                         unnormalized=unbiased, **params).numpy()

    def keys_used(q, k, draws, *, scale=None, mask=None, window=16):
        w = _weights(q, k, draws, mask=mask, window=window, defect=defect)
        if defect == "counts-draws":  # S draws counted as S keys, duplicates too
            exact = (w == 1).sum(-1)
            return (exact + draws["u"].shape[-1] * ((w > 0).sum(-1) > exact)).to(torch.float64)
        return (w > 0).sum(-1).to(torch.float64)

    limit = limit or (lambda n, m: {"window": m})
    return EstimatorSpec(
        name=f"window-sampler{'-' + defect if defect else ''}", summary="window exact, the rest sampled (test)",
        source="test", complexity="O(N M D)", params={"window": Param(16, "recent keys kept exact", kind=int)},
        draw=_draw, reference=reference, forms=BatchedForms(estimate=batched), needs_samples=True,
        is_random=lambda p: True, convergence="unbiased" if unbiased else "consistent",
        normalized=not unbiased, cost=facts.pop("cost", "linear"),
        exact_limits=(ExactLimit("the window covers every key", params=limit),),
        masks=(None, "causal", "sliding"), query_placement="independent", keys_used=keys_used, **facts)


def _results(spec, params=None, checks=GROWING):
    report = check_estimator(spec, params, checks=checks, raise_on_failure=False)
    return {r.check: r for r in report.results}


def test_a_correct_window_sampler_is_tested_beyond_its_window():
    """At the default window of 16 every check's first input is exact; each grows until the sampler samples, and
    passes there (none is skipped as exact)."""
    for spec in (_sampler(), _sampler(unbiased=True)):
        results = _results(spec)
        assert all(r.status == "passed" for r in results.values()), {c: r.message for c, r in results.items()}


@pytest.mark.parametrize(("spec", "failing"), [
    (_sampler("future"), {"causal prefix invariance", "sliding window", "query blocks"}),
    (_sampler("counts-draws"), {"keys used"}),
    (_sampler("pooled"), {"causal prefix invariance", "query blocks"}),
    (_sampler(limit=lambda n, m: {"window": 12}), {"exact limits"}),
    (_sampler("heavy", unbiased=True), {"declared convergence"}),
], ids=["future-keys", "counts-draws", "pooled-queries", "limit-of-12-keys", "biased-sampled-part"])
def test_a_defect_in_the_sampled_part_fails_on_grown_inputs(spec, failing):
    """Each defect lives in the sampled part alone, so that the window's 16 exact keys hid it from the checks' first
    inputs; on the grown ones it fails, and the message says that the inputs grew and why."""
    results = _results(spec)
    failed = {check for check, r in results.items() if r.status == "failed"}
    assert failed == failing, {c: r.message for c, r in results.items()}
    for check in failing - {"declared convergence"}:
        assert "[inputs grown from " in results[check].message, results[check].message
    if "declared convergence" in failing:
        assert "(M grown from 7, where every replicate was exact softmax)" in results["declared convergence"].message


def test_a_future_key_is_named_apart_from_a_pooled_query():
    causal = "causal prefix invariance"
    assert "it uses keys its mask hides" in _results(_sampler("future"), checks=[causal])[causal].message
    pooled = _results(_sampler("pooled"), checks=[causal])[causal].message
    assert "replacing the queries after" in pooled and "depends on later tokens" in pooled, pooled


def test_a_budget_over_every_grown_input_is_skipped_saying_so():
    """A window of 200 keys covers the 64 keys the checks grow to (and the consistency test's 128): each says it
    tested nothing, and how to."""
    results = _results(_sampler(), {"window": 200})
    for check, result in results.items():
        assert result.status == "skipped", (check, result)
        assert result.message.startswith("exact on this check's inputs (N="), result.message
        assert "grown up to M=64" in result.message or check == "declared convergence"
        assert result.message.endswith("run with a smaller budget, e.g. -p window=25"), result.message


def test_a_configuration_declared_exact_is_not_grown():
    """Softmax is exact by declaration: its masks are held by the comparison with masked softmax, and pass."""
    results = _results(randattn.get_spec("softmax"), checks=["causal prefix invariance", "sliding window"])
    assert all(r.status == "passed" for r in results.values()), results


# ------------------------------------------------------------------------------------ the unbiasedness rounding floor
def _noisy_softmax(row_zero_offset: float) -> EstimatorSpec:
    """Exact softmax plus zero-mean noise N(0, 0.05^2) on every query but the first, declared unbiased; query 0 is
    exact softmax moved by ``row_zero_offset`` (relative) and by a per-replicate rounding jitter of one ulp, as an
    estimate whose deterministic part covers a query rounds."""
    softmax = randattn.get_spec("softmax")
    eps = float(np.finfo(np.float64).eps)

    def draw(q_shape, k_shape, *, num_samples=None, replicates=1, rng=None, mask=None):
        return Draws({"g": rng.standard_normal((replicates, *q_shape[:-1], 1)),
                      "u": rng.uniform(-1, 1, (replicates, *q_shape[:-1], 1))}, replicates)

    def moved(out, g, u):
        first = out[..., :1, :] * (1 + row_zero_offset + eps * u[..., :1, :])
        rest = out[..., 1:, :] + 0.05 * g[..., 1:, :]
        return first, rest

    def reference(q, k, v, draws, **params):
        out = softmax.reference(q, k, v, Draws({}, draws.replicates), **params)
        return np.concatenate(moved(out, draws["g"], draws["u"]), axis=-2)

    def batched(q, k, v, draws, **params):
        out = softmax.batched(q, k, v, Draws({}, draws.replicates), **params)
        return torch.cat(moved(out, draws["g"].to(out.dtype), draws["u"].to(out.dtype)), dim=-2)

    return dataclasses.replace(softmax, name="noisy-softmax", draw=draw, reference=reference,
                               forms=BatchedForms(estimate=batched), is_random=lambda p: True,
                               convergence="unbiased", exact_limits=())


def test_a_query_exact_to_rounding_passes_the_unbiasedness_test():
    """Query 0 is 3 ulps from exact softmax in every replicate, with a standard error of one ulp over sqrt(4000):
    65 standard errors, as a correct Horvitz-Thompson plugin was failed with (difference 9.6e-16, standard error
    1.5e-17). The floor of 8 eps sqrt(M) max|v| on the standard error lets rounding pass."""
    eps = float(np.finfo(np.float64).eps)
    result = _results(_noisy_softmax(3 * eps), checks=["declared convergence"])["declared convergence"]
    assert result.status == "passed", result.message


@pytest.mark.parametrize("offset", [1e-9, 1e-12])
def test_a_bias_above_rounding_still_fails_the_unbiasedness_test(offset):
    """1e-12 relative is ~4500 ulps: above the floor (~5e-15 here) by far, and a bias, not rounding."""
    result = _results(_noisy_softmax(offset), checks=["declared convergence"])["declared convergence"]
    assert result.status == "failed" and "declared unbiased" in result.message, result.message
    assert "at least the rounding floor" in result.message
    floor = float(result.message.split("rounding floor ")[1].split(";")[0])
    assert 0 < floor < 1e-13 and math.isfinite(floor)
