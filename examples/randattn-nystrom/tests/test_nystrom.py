"""Tests of the Nyströmformer plugin: the protocol, the paper's equations, numerics, memory, registration."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math

import numpy as np
import pytest
import torch

import randattn
from randattn.activations import make_activations
from randattn.analysis.memory import measure_peak
from randattn.analysis.plan import SweepConfig, parse_estimator_list
from randattn.analysis.sweep import run_sweep
from randattn.estimators import EstimatorSpec, validate_spec
from randattn.testing import check_estimator, parametrize_with_checks
from randattn_nystrom import SPEC, batched, reference

VARIANTS = [pytest.param(params, id=name) for name, params in SPEC.variants.items()]

#: (id, q shape, k shape, v shape, landmarks m): batch dims, N != M, Dv != D, N = 1, m > N (clipped)
SHAPES = [
    ("b2x3-N13-M11-D8-Dv5", (2, 3, 13, 8), (2, 3, 11, 8), (2, 3, 11, 5), 4),
    ("N1-M7-D3-Dv2", (1, 3), (7, 3), (7, 2), 6),
    ("b4-N29-M29-D6", (4, 29, 6), (4, 29, 6), (4, 29, 6), 6),
    ("m20-clipped-N5-M9", (5, 4), (9, 4), (9, 3), 20),
    ("M1-single-key", (3, 6, 4), (3, 1, 4), (3, 1, 2), 5),
]


def _run(q, k, v, m, *, replicates=2, dtype=torch.float64, **params):
    """(reference, batched) on the same draws."""
    draws = SPEC.draw(q.shape, k.shape, num_samples=m, replicates=replicates)
    ref = SPEC.reference(q, k, v, draws, **params)
    t = lambda a: torch.as_tensor(a, dtype=dtype)  # noqa: E731
    return ref, SPEC.batched(t(q), t(k), t(v), draws.to_torch(dtype=dtype), **params)


def _softmax_attention(q, k, v, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = scale * q @ np.swapaxes(k, -1, -2)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


@parametrize_with_checks([(SPEC, params) for params in SPEC.variants.values()])
def test_conformance(estimator, check):
    """randattn's conformance kit (the checks every built-in passes), on each variant."""
    check(estimator)


def test_spec_is_valid():
    assert validate_spec(SPEC) is SPEC
    assert not SPEC.is_random(SPEC.resolve_params({})) and SPEC.cost_of({}) == "linear"


def test_the_landmarks_pool_the_queries_present():
    """Segment means of the queries: the last 3 queries alone give other outputs than those rows of every query, so
    the spec declares the placement 'proportional', and a subset of the queries is refused by mse."""
    from randattn.analysis.queries import QueryPlacementError, check_query_selection

    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(3, 12, 4))
    whole = randattn.estimate(SPEC, q, k, v, num_samples=3)[-3:]
    alone = randattn.estimate(SPEC, q[-3:], k, v, num_samples=3)
    assert np.abs(whole - alone).max() > 1e-3
    assert SPEC.query_placement_of({}) == "proportional"
    registered = "nystrom" in randattn.list_estimators()  # installed, its entry point names it
    if not registered:
        randattn.register_estimator(SPEC)
    try:
        with pytest.raises(QueryPlacementError):
            check_query_selection("last:3", 12, {0: None}, [parse_estimator_list("nystrom")[0]])
    finally:
        if not registered:
            randattn.unregister_estimator(SPEC.name)


def test_the_earlier_protocol_still_declares_this_plugin():
    """``batched=batched.estimate``, as this plugin was written before ``forms=BatchedForms(...)``: the same spec,
    with a DeprecationWarning naming the new way; it passes the kit's checks of its forms and runs in a sweep."""
    facts = {f.name: getattr(SPEC, f.name) for f in dataclasses.fields(SPEC) if f.name not in ("name", "forms")}
    with pytest.warns(DeprecationWarning, match=r"forms=BatchedForms\(estimate=\.\.\.\)"):
        old = EstimatorSpec(name="nystrom-old-protocol", **facts, batched=batched.estimate)
    assert old.forms == SPEC.forms and old.batched is batched.estimate
    checks = ["spec is valid", "reference == batched (float64)"]
    assert {r.check: r.status for r in check_estimator(old, checks=checks).results} == dict.fromkeys(checks, "passed")
    randattn.register_estimator(old)
    try:
        rng = np.random.default_rng(9)
        acts = make_activations({0: tuple(rng.normal(size=(1, 2, 12, 4)) for _ in range(3))}, {"scale": 0.5})
        config = SweepConfig(estimators=parse_estimator_list(old.name), num_samples=(3,), replicates=1, seed=0,
                             diagnostics=False)
        table = run_sweep(acts, config)
    finally:
        randattn.unregister_estimator(old.name)
    assert len(table) == 2 and table["mse"].notna().all() and table["prob_mse"].notna().all()  # one row per head


@pytest.mark.parametrize("params", VARIANTS)
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_batched_float64_matches_reference(shape, params):
    _, q_shape, k_shape, v_shape, m = shape
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal(q_shape), rng.standard_normal(k_shape), rng.standard_normal(v_shape)
    ref, bat = _run(q, k, v, m, replicates=3, **params)
    assert ref.shape == (3, *q_shape[:-1], v_shape[-1]) and ref.dtype == np.float64
    assert bat.shape == ref.shape and bat.dtype == torch.float64
    np.testing.assert_allclose(bat.numpy(), ref, rtol=1e-10, atol=1e-10)
    assert np.array_equal(ref[0], ref[-1]), "deterministic: every replicate is the same output"


@pytest.mark.parametrize("params", VARIANTS)
def test_batched_float32_close_to_reference(params):
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((3, 2, 13, 8))
    ref, bat = _run(q, k, v, 4, dtype=torch.float32, **params)
    assert bat.dtype == torch.float32
    np.testing.assert_allclose(bat.double().numpy(), ref, rtol=5e-5, atol=5e-5)


def _paper_by_hand(q, k, v, q_bounds, k_bounds, pinv):
    """Eq. 16, 13, 17 with explicit loops, and eq. 14 written out again; nothing from the package."""
    s = 1 / math.sqrt(q.shape[1])
    q_lm = np.array([q[a:b].mean(0) for a, b in zip(q_bounds, q_bounds[1:])])
    k_lm = np.array([k[a:b].mean(0) for a, b in zip(k_bounds, k_bounds[1:])])

    def softmax_rows(x, y):
        out = np.empty((len(x), len(y)))
        for i in range(len(x)):
            e = [math.exp(s * float(x[i] @ y[j])) for j in range(len(y))]
            out[i] = [ej / sum(e) for ej in e]
        return out

    f, a, b = softmax_rows(q, k_lm), softmax_rows(q_lm, k_lm), softmax_rows(q_lm, k)
    if pinv == "exact":
        z = np.linalg.pinv(a)
    else:
        col = max(sum(abs(a[i, j]) for i in range(len(a))) for j in range(len(a)))
        row = max(sum(abs(a[i, j]) for j in range(len(a))) for i in range(len(a)))
        z, eye = a.T / (col * row), np.eye(len(a))
        for _ in range(6):
            z = 0.25 * z @ (13 * eye - a @ z @ (15 * eye - a @ z @ (7 * eye - a @ z)))
    return f @ z @ b @ v


@pytest.mark.parametrize("pinv", ["iterative", "exact"])
def test_matches_the_paper_written_out(pinv):
    rng = np.random.default_rng(2)
    q, k, v = rng.standard_normal((7, 3)), rng.standard_normal((5, 3)), rng.standard_normal((5, 2))
    # m = 3: floor(j N / 3) gives segments [0, 2), [2, 4), [4, 7) of the queries, [0, 1), [1, 3), [3, 5) of the keys
    expected = _paper_by_hand(q, k, v, [0, 2, 4, 7], [0, 1, 3, 5], pinv)
    ref, bat = _run(q, k, v, 3, pinv=pinv)
    np.testing.assert_allclose(ref[0], expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(bat[0].numpy(), expected, rtol=1e-12, atol=1e-12)


def test_iterative_pinv_converges_to_the_pseudoinverse():
    rng = np.random.default_rng(3)
    logits = 3 * np.eye(6) + 0.3 * rng.standard_normal((6, 6))
    a = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)  # a softmax matrix, cond ~ 3
    assert np.linalg.cond(a) < 10
    errors = [np.abs(reference.iterative_pinv(a, j) - np.linalg.pinv(a)).max() for j in range(8)]
    # third order (Lemma 1): 0.67, 0.18, 3.5e-3, 3.7e-8, then rounding (1e-15)
    assert all(later < earlier for earlier, later in zip(errors, errors[1:]) if earlier > 1e-13), errors
    assert errors[0] > 0.1 and errors[3] < 1e-6 and max(errors[4:]) < 1e-13


def test_many_iterations_match_exact_pinv_on_a_well_conditioned_input():
    rng = np.random.default_rng(4)
    q, k, v = rng.standard_normal((3, 2, 24, 8))
    many, _ = _run(q, k, v, 4, pinv_iterations=30)
    exact, _ = _run(q, k, v, 4, pinv="exact")
    np.testing.assert_allclose(many, exact, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("n, m", [(16, 16), (29, 29), (13, 11), (11, 13), (1, 7), (7, 1)])
def test_exact_limit_is_softmax(n, m):
    """Every token of the shorter side a landmark and A^+ exact: softmax attention, to the declared rtol."""
    (limit,) = SPEC.exact_limits
    params, samples = limit.resolve(n, m)
    for seed in range(5):
        rng = np.random.default_rng(seed)
        q, k, v = rng.standard_normal((n, 8)), rng.standard_normal((m, 8)), rng.standard_normal((m, 3))
        ref, bat = _run(q, k, v, samples, **params)
        exact = _softmax_attention(q, k, v)
        for out in (ref[0], bat[0].numpy()):
            np.testing.assert_allclose(out, exact, rtol=limit.rtol, atol=limit.rtol * np.abs(exact).max())


@pytest.mark.parametrize("params", VARIANTS)
def test_single_key_returns_its_value(params):
    """M = 1: one landmark, A = B = [1], and Z_j = 1 for every j, so each query gets v exactly."""
    rng = np.random.default_rng(8)
    q, k, v = rng.standard_normal((2, 5, 4)), rng.standard_normal((2, 1, 4)), rng.standard_normal((2, 1, 3))
    ref, bat = _run(q, k, v, 4, **params)
    np.testing.assert_allclose(ref, np.broadcast_to(v, ref.shape), rtol=1e-15, atol=0)
    np.testing.assert_allclose(bat.numpy(), ref, rtol=1e-15, atol=0)


@pytest.mark.parametrize("params", VARIANTS)
def test_finite_at_large_key_norms(params):
    """Keys of norm ~150, queries up to 30 (ViT-like): the max-subtracted softmaxes keep every output finite."""
    rng = np.random.default_rng(5)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = unit(rng.standard_normal((2, 50, 64))) * rng.uniform(1, 30, (2, 50, 1))
    k = unit(rng.standard_normal((2, 50, 64))) * rng.uniform(100, 150, (2, 50, 1))
    v = rng.standard_normal((2, 50, 64))
    for dtype in (torch.float64, torch.float32):
        ref, bat = _run(q, k, v, 8, dtype=dtype, **params)
        assert np.isfinite(ref).all() and torch.isfinite(bat).all()


def test_no_n_by_m_tensor():
    """N = M = 2048: the batched form's peak memory is a small fraction of one float32 N x M matrix."""
    n, d, m = 2048, 32, 32
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, d, generator=g) for _ in range(3))
    draws = SPEC.draw(q.shape, k.shape, num_samples=m).to_torch(dtype=torch.float32)
    for pinv in ("iterative", "exact"):
        peak = measure_peak(lambda: SPEC.batched(q, k, v, draws, pinv=pinv), torch_tensors=True)
        assert peak < n * n * 4 / 4, f"{pinv}: peak {peak / 2**20:.1f} MiB"
    # the measurement does see torch tensors: exact softmax holds its N x M scores
    peak = measure_peak(lambda: torch.softmax(q @ k.T, -1) @ v, torch_tensors=True)
    assert peak >= n * n * 4


@pytest.mark.parametrize("pinv", ["iterative", "exact"])
def test_runs_on_the_meta_device(pinv):
    """Tensors without data: any value read back to the host (.item(), .cpu()) would raise, so none is,
    and the batched form runs on a GPU unchanged, without syncs."""
    q, k, v = (torch.empty(2, 197, 64, device="meta") for _ in range(3))
    draws = SPEC.draw(q.shape, k.shape, num_samples=49, replicates=3).to_torch(device="meta", dtype=torch.float32)
    out = SPEC.batched(q, k, v, draws, pinv=pinv)
    assert out.shape == (3, 2, 197, 64) and out.device.type == "meta" and out.dtype == torch.float32


def test_draw_is_deterministic_and_carries_m():
    first = SPEC.draw((2, 9, 4), (2, 7, 4), num_samples=5, replicates=3, rng=np.random.default_rng(0))
    again = SPEC.draw((2, 9, 4), (2, 7, 4), num_samples=5, replicates=3, rng=np.random.default_rng(1))
    assert first["landmark_slots"].shape == again["landmark_slots"].shape == (3, 2, 5, 0)
    with pytest.raises(ValueError, match="integer >= 1"):
        SPEC.draw((9, 4), (7, 4), num_samples=0)


def test_bad_options_and_draws_are_named():
    rng = np.random.default_rng(6)
    q, k, v = rng.standard_normal((3, 6, 4))
    draws = SPEC.draw(q.shape, k.shape, num_samples=2)
    with pytest.raises(ValueError, match="pinv_iterations must be an integer >= 0"):
        SPEC.reference(q, k, v, draws, pinv_iterations=-1)
    with pytest.raises(ValueError, match="pinv='svd' is not allowed"):
        SPEC.batched(torch.as_tensor(q), torch.as_tensor(k), torch.as_tensor(v), draws.to_torch(), pinv="svd")
    with pytest.raises(ValueError, match="inputs of another shape"):
        SPEC.reference(q[None], k[None], v[None], draws)


def test_registered_through_the_entry_point():
    try:
        importlib.metadata.distribution("randattn-nystrom")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("randattn-nystrom is not installed (pip install -e examples/randattn-nystrom)")
    assert "nystrom" in randattn.list_estimators()
    assert randattn.get_spec("nystrom") is SPEC
    rng = np.random.default_rng(7)
    q, k, v = rng.standard_normal((3, 2, 10, 4))
    out = randattn.estimate("nystrom", q, k, v, num_samples=3, backend="torch", dtype=torch.float64)
    np.testing.assert_allclose(out.numpy(), randattn.estimate("nystrom", q, k, v, num_samples=3), rtol=1e-10, atol=1e-10)
