"""What the deterministic selection estimators (top-k, StreamingLLM, Quest) share, checked on each: batched == reference
in float64 in the decode regime, the implied probabilities, keys_used in both forms, large norms, the budget draws."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from randattn.estimators import quest, streaming, topk
from randattn.estimators.base import Draws
from randattn.testing import TOLERANCES, assert_close

#: (id, spec, reference module, params, S)
CONFIGURATIONS = [
    ("topk", topk.SPEC, topk.reference, {}, 7),
    ("streaming", streaming.SPEC, streaming.reference, {}, 8),
    ("quest", quest.SPEC, quest.reference, {"page_size": 4}, 8),
    ("quest-keep", quest.SPEC, quest.reference, {"page_size": 4, "current_page": "keep"}, 8),
]
#: (id, q shape, k shape, v shape): decode (3 queries over 40 keys) and batched self-attention with a partial page
SHAPES = [("decode-N3-M40", (3, 6), (40, 6), (40, 2)), ("b2-N13-M13", (2, 13, 5), (2, 13, 5), (2, 13, 3))]
MASKS = [None, "causal"]


def _case(config, shape, mask, norm=1.0):
    _, spec, ref, params, budget = config
    _, q_shape, k_shape, v_shape = shape
    rng = np.random.default_rng(len(q_shape) * 100 + q_shape[-2])
    q, k, v = rng.standard_normal(q_shape) * norm, rng.standard_normal(k_shape) * norm, rng.standard_normal(v_shape)
    kw = {"mask": mask} if mask else {}
    draws = spec.draw(q.shape, k.shape, num_samples=budget, replicates=2, **params, **kw)
    t = lambda a: torch.as_tensor(a, dtype=torch.float64)  # noqa: E731
    return spec, ref, {**params, **kw}, (q, k, v, draws), (t(q), t(k), t(v), draws.to_torch())


@pytest.fixture(params=CONFIGURATIONS, ids=[c[0] for c in CONFIGURATIONS])
def config(request):
    return request.param


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_batched_matches_reference_with_probabilities_and_keys_used(config, shape, mask):
    """float64, same draws: outputs and probabilities to 1e-10 (ARCHITECTURE sec. 3), keys_used equal; the
    probabilities are the output with v = I, estimate_with_probabilities gives the separate calls' bits."""
    spec, ref, params, (q, k, v, draws), (tq, tk, tv, tdraws) = _case(config, shape, mask)
    atol, rtol = TOLERANCES["float64"]
    out = spec.batched(tq, tk, tv, tdraws, **params)
    assert out.shape == (2, *q.shape[:-1], v.shape[-1])
    assert_close(out, ref.estimate(q, k, v, draws, **params), atol=atol, rtol=rtol, what="batched vs reference:")
    probabilities = spec.batched_probabilities(tq, tk, tdraws, **params)
    assert_close(probabilities, ref.probabilities(q, k, draws, **params), atol=atol, rtol=rtol,
                 what="batched probabilities vs reference:")
    identity = np.broadcast_to(np.eye(k.shape[-2]), (*k.shape[:-2], k.shape[-2], k.shape[-2]))
    assert_close(ref.estimate(q, k, identity, draws, **params), probabilities, atol=atol, rtol=rtol,
                 what="reference with v = I vs batched probabilities:")
    both = spec.batched_with_probabilities(tq, tk, tv, tdraws, **params)
    assert torch.equal(both[0], out) and torch.equal(both[1], probabilities)
    used = spec.keys_used(tq, tk, tdraws, **params)
    assert used.dtype == torch.float64 and used.shape == (2, *q.shape[:-1])
    assert np.array_equal(used.numpy(), ref.keys_used(q, k, draws, **params))
    assert np.array_equal(used.numpy(), (probabilities > 0).sum(-1).numpy())
    assert (used.numpy() <= config[4]).all()


@pytest.mark.parametrize("mask", MASKS)
def test_large_norms_stay_finite(config, mask):
    """Queries and keys with entries of size 300 (norms ~700, logits ~1e5): finite, both forms agree."""
    spec, ref, params, (q, k, v, draws), (tq, tk, tv, tdraws) = _case(config, SHAPES[0], mask, norm=300.0)
    expected = ref.estimate(q, k, v, draws, **params)
    assert np.isfinite(expected).all()
    out = spec.batched(tq, tk, tv, tdraws, **params)
    assert_close(out, expected, atol=1e-10 * np.abs(v).max(), rtol=1e-10, what="large norms, batched vs reference:")


def test_draws_carry_the_budget_only_with_the_batch_dims(config):
    """``budget : (R, ...)``: a replicate dim and the batch dims, like every draw (a sweep slices draws by cell)."""
    _, spec, _, params, budget = config
    draws = spec.draw((2, 5, 3, 4), (2, 5, 9, 4), num_samples=budget, replicates=3, rng=np.random.default_rng(0),
                      **params)
    assert set(draws.arrays) == {"budget"} and draws.replicates == 3
    assert draws["budget"].dtype == np.float64 and draws["budget"].shape == (3, 2, 5)
    assert (draws["budget"] == budget).all()


@pytest.mark.parametrize("mask", MASKS)
def test_batched_forms_read_nothing_back_from_an_accelerator(config, mask):
    """Under FakeTensorMode on the ``meta`` device (as tests/gpu/test_fake_device.py) every batched form runs: no
    ``.item()``, no host copy of the budget, no operand left on the CPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    spec, _, params, (q, k, v, draws), _ = _case(config, SHAPES[1], mask)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = [torch.empty(a.shape, dtype=torch.float32, device="meta") for a in (q, k, v)]
        fake_draws = Draws({"budget": torch.empty(draws["budget"].shape, device="meta")}, draws.replicates)
        out, probabilities = spec.batched_with_probabilities(*fake, fake_draws, **params)
        used = spec.keys_used(fake[0], fake[1], fake_draws, **params)
    assert out.device.type == probabilities.device.type == used.device.type == "meta"
    assert tuple(used.shape) == (2, *q.shape[:-1])


def test_draws_without_one_budget_are_refused(config):
    _, spec, ref, params, budget = config
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((3, 4)), rng.standard_normal((9, 4)), rng.standard_normal((9, 2))
    for values, words in (([budget, budget + 1.0], "one positive integer"), ([0.5, 0.5], "one positive integer")):
        with pytest.raises(ValueError, match=words):
            ref.estimate(q, k, v, Draws({"budget": np.array(values)}, 2), **params)
    with pytest.raises(KeyError, match="budget"):
        ref.estimate(q, k, v, Draws({"omega": np.zeros((1, 2, 4))}, 1), **params)
