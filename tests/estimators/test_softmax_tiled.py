"""Exact attention by tiles (``softmax.tiled``): the flash recurrence against the dense float64 reference.

Expected values come from computations independent of the tiled code: ``softmax.reference`` (scipy's
max-subtracted softmax of the whole N x M logits), scipy.special.logsumexp of the masked logits written out
here, and ``masks.causal_visible`` for which blocks hold a visible key.

Tolerances: both forms are exact, so they differ by rounding only. The output is a convex combination of the
values, so its error is measured against max|v|: 1e-12 max|v| (+ 1e-12 relative) at moderate logits. At large
logits L the rounding of a logit (L eps relative, shared by exp) dominates: 8 L eps max|v|, the conformance
kit's bound (``randattn.testing.checks``), as ``test_causal_softmax``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.special import logsumexp

from randattn.analysis.memory import measure_peak
from randattn.estimators.masks import Mask, causal_visible
from randattn.estimators.softmax import batched as softmax_batched
from randattn.estimators.softmax import reference as softmax_ref
from randattn.estimators.softmax.tiled import tiled_attention, tiled_probabilities
from randattn.testing import assert_close

EPS64 = float(np.finfo(np.float64).eps)
EPS32 = float(np.finfo(np.float32).eps)


def _inputs(seed: int, n: int, m: int, *, batch=(2,), d=5, dv=3, q_size=1.0, k_size=1.0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((*batch, n, d)) * q_size, rng.standard_normal((*batch, m, d)) * k_size,
            rng.standard_normal((*batch, m, dv)))


def _masked_logits(q, k, mask):
    """scale q.k with -inf where ``mask`` hides the key: the whole N x M array, written out (small sizes only);
    ``"sliding:W"``: also the keys m <= n + M - N - W."""
    logits = q.shape[-1] ** -0.5 * (q @ np.swapaxes(k, -1, -2))
    if mask is not None:
        logits = np.where(causal_visible(q.shape[-2], k.shape[-2]), logits, -np.inf)
    if mask is not None and mask.startswith("sliding:"):
        n, m, window = q.shape[-2], k.shape[-2], int(mask.split(":")[1])
        before = np.arange(m)[None, :] <= (np.arange(n) + m - n - window)[:, None]
        logits = np.where(before, -np.inf, logits)
    return logits


# (N, M, query_tile, key_tile, batch): N = M, N < M (decode: the last N of M), N = 1, odd sizes that no tile
# divides, tiles of 1, tiles larger than N and M, two batch dims
CASES = [
    (8, 8, 4, 4, (2,)),
    (7, 7, 3, 2, (2,)),
    (5, 13, 2, 4, (2,)),
    (1, 9, 1, 4, (2,)),
    (1, 1, 1, 1, (2,)),
    (11, 17, 1, 1, (2,)),
    (9, 23, 100, 100, (2,)),
    (13, 13, 5, 3, (2, 3)),
    (6, 31, 4, 5, ()),
]
IDS = [f"N{n}-M{m}-Tq{tq}-Tk{tk}-B{'x'.join(map(str, b)) or '0'}" for n, m, tq, tk, b in CASES]


@pytest.mark.parametrize("mask", [None, "causal", "sliding:1", "sliding:3", "sliding:40"],
                         ids=["bidirectional", "causal", "window-1", "window-3", "window-40"])
@pytest.mark.parametrize("n, m, tq, tk, batch", CASES, ids=IDS)
def test_output_and_log_normaliser_equal_the_dense_reference(n, m, tq, tk, batch, mask):
    """Every case against the dense reference; a window of 1 or 3 keys is narrower than most query tiles, so a
    tile's later queries see none of its first key tile (their running maximum stays -inf there: no NaN)."""
    q, k, v = _inputs(1, n, m, batch=batch, d=6, dv=4)
    out, lse = tiled_attention(q, k, v, mask=mask, query_tile=tq, key_tile=tk)
    assert out.dtype == lse.dtype == torch.float64
    assert out.shape == (*batch, n, 4) and lse.shape == (*batch, n)
    scale_v = np.abs(v).max()
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert_close(out, softmax_ref.estimate(q, k, v, mask=mask), atol=1e-12 * scale_v, rtol=1e-12, what="output:")
    expected_lse = logsumexp(_masked_logits(q, k, mask), axis=-1)
    assert_close(lse, expected_lse, atol=1e-12 * np.abs(expected_lse).max(), rtol=1e-12, what="log-normaliser:")


def test_negative_control_an_off_by_one_mask_fails_the_comparison():
    """The comparison above sees a mask shifted by one key: the bidirectional output is far from the causal."""
    q, k, v = _inputs(2, 8, 8)
    out, _ = tiled_attention(q, k, v, mask="causal", query_tile=3, key_tile=3)
    shifted = softmax_ref.estimate(q[..., :-1, :], k, v, mask="causal")  # 7 queries over 8 keys: n sees m <= n + 1
    with pytest.raises(AssertionError, match="not close"):
        assert_close(out[..., :-1, :], shifted, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("mask", [None, "causal"], ids=["bidirectional", "causal"])
def test_large_norms_do_not_overflow(mask):
    """Query and key norms 110-150: logits beyond 709, where a naive exp overflows to inf (asserted)."""
    q, k, v = _inputs(3, 12, 20, d=16, dv=3)
    rng = np.random.default_rng(31)
    q, k = (a / np.linalg.norm(a, axis=-1, keepdims=True) * rng.uniform(110, 150, a.shape[:-1])[..., None]
            for a in (q, k))
    logits = _masked_logits(q, k, mask)
    largest = np.abs(logits[np.isfinite(logits)]).max()
    with np.errstate(over="ignore"):
        assert np.isinf(np.exp(logits)).any(), "the case must be one where a naive exp overflows"
    out, lse = tiled_attention(q, k, v, mask=mask, query_tile=5, key_tile=3)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    tol = 8 * largest * EPS64 * np.abs(v).max()
    assert_close(out, softmax_ref.estimate(q, k, v, mask=mask), atol=tol, what="output:")
    assert_close(lse, logsumexp(logits, axis=-1), atol=8 * largest * EPS64, what="log-normaliser:")


@pytest.mark.parametrize("n, m", [(10, 10), (6, 10)], ids=["N10-M10", "N6-M10"])
def test_junk_after_the_last_visible_key_changes_nothing(n, m):
    """Causal: keys and values after query ``cut``'s last visible key replaced by junk (norms x 50, values
    x 1e3) leave rows 0..cut of the output and the log-normaliser bit-identical; junk at the last visible key
    itself (the negative control) changes row ``cut``."""
    q, k, v = _inputs(4, n, m)
    q, k, v = (torch.as_tensor(a) for a in (q, k, v))
    out, lse = tiled_attention(q, k, v, mask="causal", query_tile=3, key_tile=4)
    rng = np.random.default_rng(5)
    for cut in range(n - 1):
        last = cut + (m - n)
        junk_k, junk_v = k.clone(), v.clone()
        junk_k[..., last + 1:, :] = torch.as_tensor(rng.standard_normal(junk_k[..., last + 1:, :].shape) * 50)
        junk_v[..., last + 1:, :] = torch.as_tensor(rng.standard_normal(junk_v[..., last + 1:, :].shape) * 1e3)
        junk_out, junk_lse = tiled_attention(q, junk_k, junk_v, mask="causal", query_tile=3, key_tile=4)
        assert torch.equal(junk_out[..., : cut + 1, :], out[..., : cut + 1, :]), f"cut={cut}"
        assert torch.equal(junk_lse[..., : cut + 1], lse[..., : cut + 1]), f"cut={cut}"
        junk_v[..., last, :] += 1.0
        seen_out, _ = tiled_attention(q, junk_k, junk_v, mask="causal", query_tile=3, key_tile=4)
        assert not torch.equal(seen_out[..., cut, :], out[..., cut, :]), f"cut={cut}: the control saw no change"


@pytest.mark.parametrize("mask", [None, "causal", "sliding:3"], ids=["bidirectional", "causal", "window-3"])
@pytest.mark.parametrize("n, m, tq, tk", [(7, 7, 3, 2), (5, 13, 2, 4), (9, 9, 9, 9)], ids=["N7", "N5-M13", "one"])
def test_probability_blocks_equal_the_reference_and_rows_sum_to_one(n, m, tq, tk, mask):
    q, k, v = _inputs(6, n, m, d=6)
    _, lse = tiled_attention(q, k, v, mask=mask, query_tile=tq, key_tile=tk)
    expected = softmax_ref.attention_probabilities(q, k, mask=mask)
    for n0 in range(0, n, tq):
        rows = np.zeros((2, min(n0 + tq, n) - n0))
        for k0 in range(0, m, tk):
            block = tiled_probabilities(q, k, lse, mask=mask, query_slice=slice(n0, n0 + tq),
                                        key_slice=slice(k0, k0 + tk))
            assert_close(block, expected[..., n0:n0 + tq, k0:k0 + tk], atol=1e-12, rtol=1e-12,
                         what=f"block ({n0}, {k0}):")
            if mask is not None:  # hidden entries are exact zeros
                hidden = ~Mask.parse(mask).visible(n, m)[n0:n0 + tq, k0:k0 + tk]
                assert (block.numpy()[..., hidden] == 0).all()
            rows += block.sum(dim=-1).numpy()
        # a sum of M terms each rounded to eps relative: M eps
        assert_close(rows, np.ones_like(rows), atol=m * EPS64, what=f"row sums of query tile {n0}:")


def test_causal_skips_key_tiles_wholly_hidden_from_a_query_tile():
    """The matrix products run equal two per (query tile, key tile) block holding a visible key, counted from
    ``causal_visible``; the bidirectional count (every block) is the negative control. A sliding window reads the
    key tiles of its band only."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountProducts(TorchDispatchMode):
        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            return False  # as randattn.analysis.memory: skipping would import torch._dynamo (seconds)

        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.bmm):
                self.count += 1
            return func(*args, **(kwargs or {}))

    n, m, tq, tk = 10, 14, 3, 4
    q, k, v = (torch.as_tensor(a) for a in _inputs(7, n, m))
    visible = causal_visible(n, m)
    blocks = [(n0, k0) for n0 in range(0, n, tq) for k0 in range(0, m, tk)]
    with_visible = sum(bool(visible[n0:n0 + tq, k0:k0 + tk].any()) for n0, k0 in blocks)
    counts = {}
    for mask in (None, "causal"):
        with CountProducts() as counter:
            tiled_attention(q, k, v, mask=mask, query_tile=tq, key_tile=tk)
        counts[mask] = counter.count
    assert counts["causal"] == 2 * with_visible < 2 * len(blocks) == counts[None], counts

    n, m, tq, tk, window = 40, 40, 4, 4, 3
    q, k, v = (torch.as_tensor(a) for a in _inputs(8, n, m))
    with CountProducts() as counter:
        tiled_attention(q, k, v, mask=f"sliding:{window}", query_tile=tq, key_tile=tk)
    # a query tile's keys span W - 1 + Tq = 6 positions, so at most 3 key tiles of 4 hold them, whatever M: two
    # products each, over 10 query tiles (the causal loop would take 110)
    assert counter.count <= 2 * (n // tq) * 3, counter.count


def test_float32_inputs_and_float32_recurrence():
    """float32 inputs with the default float64 recurrence: the float64 truth of those very inputs (no copy
    rounds them further); ``dtype=torch.float32``: within 8 L eps32 max|v| of it."""
    q, k, v = (a.astype(np.float32) for a in _inputs(8, 9, 12, d=8, q_size=3.0, k_size=3.0))
    truth = softmax_ref.estimate(q, k, v, mask="causal")
    out64, _ = tiled_attention(torch.as_tensor(q), torch.as_tensor(k), torch.as_tensor(v), mask="causal",
                               query_tile=4, key_tile=5)
    assert out64.dtype == torch.float64
    assert_close(out64, truth, atol=1e-12 * np.abs(v).max(), rtol=1e-12, what="float64 recurrence:")
    out32, lse32 = tiled_attention(torch.as_tensor(q), torch.as_tensor(k), torch.as_tensor(v), mask="causal",
                                   query_tile=4, key_tile=5, dtype=torch.float32)
    assert out32.dtype == lse32.dtype == torch.float32
    largest = np.abs(_masked_logits(q.astype(np.float64), k.astype(np.float64), None)).max()
    assert_close(out32, truth, atol=8 * largest * EPS32 * np.abs(v).max(), what="float32 recurrence:")


def test_same_inputs_same_bits():
    q, k, v = (torch.as_tensor(a) for a in _inputs(9, 11, 11))
    first = tiled_attention(q, k, v, mask="causal", query_tile=4, key_tile=3)
    second = tiled_attention(q, k, v, mask="causal", query_tile=4, key_tile=3)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"query_tile": 0}, "query_tile must be >= 1, got 0"),
        ({"key_tile": -3}, "key_tile must be >= 1, got -3"),
        ({"mask": "sliding"}, "mask='sliding' is not allowed"),
        ({"dtype": torch.float16}, "dtype=torch.float16 is not allowed"),
    ],
    ids=["query_tile-0", "key_tile-negative", "unknown-mask", "float16"],
)
def test_bad_arguments_raise_value_error_naming_them(kwargs, match):
    q, k, v = _inputs(10, 4, 6)
    with pytest.raises(ValueError, match=match):
        tiled_attention(q, k, v, **kwargs)


def test_bad_shapes_raise_value_error_naming_the_problem():
    q, k, v = _inputs(11, 6, 4)
    with pytest.raises(ValueError, match="at least as many keys as queries.*N=6 queries and M=4 keys"):
        tiled_attention(q, k, v, mask="causal")
    with pytest.raises(ValueError, match="same feature dim D"):
        tiled_attention(q[..., :4], k, v)
    with pytest.raises(ValueError, match="same number of tokens M"):
        tiled_attention(q, k, v[..., :3, :])
    with pytest.raises(ValueError, match="same batch dims"):
        tiled_attention(q[:1], k, v)
    with pytest.raises(TypeError, match="key_tile must be an integer"):
        tiled_attention(q, k, v, key_tile=2.0)


def test_probabilities_bad_input_raises_value_error_naming_the_problem():
    q, k, v = _inputs(12, 4, 6)
    _, lse = tiled_attention(q, k, v)
    with pytest.raises(ValueError, match=r"log_normaliser must have shape \(..., N\) = \(2, 4\).*got \(2, 3\)"):
        tiled_probabilities(q, k, lse[..., :3], query_slice=slice(0, 2), key_slice=slice(0, 2))
    with pytest.raises(ValueError, match="query_slice=slice\\(0, 4, 2\\) must have step 1"):
        tiled_probabilities(q, k, lse, query_slice=slice(0, 4, 2), key_slice=slice(0, 2))
    with pytest.raises(ValueError, match="key_slice=slice\\(6, 9, None\\) selects no index of 6"):
        tiled_probabilities(q, k, lse, query_slice=slice(0, 2), key_slice=slice(6, 9))
    with pytest.raises(ValueError, match="at least as many keys"):
        tiled_probabilities(k, q, lse, mask="causal", query_slice=slice(0, 2), key_slice=slice(0, 2))


@pytest.mark.parametrize("kind", [np.nan, np.inf], ids=["nan", "inf"])
def test_a_probability_block_refuses_bad_values_in_the_rows_it_reads_and_reads_no_others(kind):
    """Each block reads the values of its own rows of q and k only: a pass over M / Tk key tiles that checked all of
    k on every call did O(M^2 / Tk) work. A bad value in the block's rows is refused; one elsewhere does not touch
    the block, which equals the dense reference's."""
    q, k, v = _inputs(13, 4, 6)
    _, lse = tiled_attention(q, k, v)
    bad_k, bad_q = k.copy(), q.copy()
    bad_k[1, 5, 2], bad_q[0, 3, 1] = kind, kind
    for first, last in ((5, 6), (4, 6)):  # the bad row first in the block, then last
        with pytest.raises(ValueError, match="^k contains NaN or infinite values$"):
            tiled_probabilities(q, bad_k, lse, query_slice=slice(0, 4), key_slice=slice(first, last))
    for first, last in ((3, 4), (2, 4)):
        with pytest.raises(ValueError, match="^q contains NaN or infinite values$"):
            tiled_probabilities(bad_q, k, lse, query_slice=slice(first, last), key_slice=slice(0, 2))
    block = tiled_probabilities(bad_q, bad_k, lse, query_slice=slice(0, 3), key_slice=slice(0, 5)).numpy()
    logits = _masked_logits(q, k, None)
    dense = np.exp(logits - logsumexp(logits, axis=-1, keepdims=True))
    np.testing.assert_allclose(block, dense[..., :3, :5], rtol=1e-13, atol=0)


def _peak_extra(func, *inputs: torch.Tensor) -> int:
    """Peak bytes ``func()`` allocates beyond its inputs, its output included (as ``benchmarks/bench_causal``):
    ``measure_peak`` counts a storage the first time an operator returns it, so the inputs are viewed first to
    register them, and their bytes taken off."""
    def run():
        for t in inputs:
            t.view(t.shape)
        func()

    return measure_peak(run, torch_tensors=True) - sum(t.untyped_storage().nbytes() for t in inputs)


@pytest.fixture
def one_thread():
    """torch on one thread for the test, restored after: the memory test measures bytes, not time, and on a
    shared 2-core host each of its few hundred small operators otherwise waits for a descheduled second
    OpenMP thread (3.5 s instead of 0.1 s for the 36 blocks at N = 1024 under a load of 9)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    "n, tile",
    [(1024, 128), pytest.param(4096, 256, marks=pytest.mark.slow)],
    ids=["N1024-T128", "N4096-T256"],
)
def test_peak_memory_is_the_output_and_a_block_never_n_by_m(n, tile, one_thread):
    """N = M, D = Dv = 64, float64, causal, tiles Tq = Tk.

    Bound asserted (8-byte numbers, per batch element; one here): the output and log-normaliser,
    N (Dv + 1) 8, plus, twice over (a query tile's states can outlive the next tile's by one assignment),
    one block's logits and boolean mask Tq Tk (8 + 1), the scaled query tile, the running output and its
    update Tq (D + 2 Dv) 8, and at most 8 vectors of Tq numbers. At N = 4096, T = 256: 2.03 + 1.91 = 3.94 MiB
    against the N M 8 = 128 MiB of the scores alone (at N = 1024, T = 128: 1.18 MiB against 8 MiB). The dense
    softmax of ``softmax.batched`` measured the same way must exceed N M 8 (the control: the measurement sees
    an N x M array when one is made).
    """
    m, d, dv = n, 64, 64
    g = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(1, t, w, generator=g, dtype=torch.float64) for t, w in ((n, d), (m, d), (m, dv)))
    bound = n * (dv + 1) * 8 + 2 * (tile * tile * (8 + 1) + tile * (d + 2 * dv) * 8 + 8 * tile * 8)
    assert n * m * 8 > 5 * bound
    tiled = _peak_extra(lambda: tiled_attention(q, k, v, mask="causal", query_tile=tile, key_tile=tile), q, k, v)
    assert n * dv * 8 <= tiled <= bound, (tiled, bound)
    dense = _peak_extra(lambda: softmax_batched.estimate(q, k, v, mask="causal"), q, k, v)
    assert dense > n * m * 8, (dense, bound)
