"""A capture's sliding-window mask held a block of rows at a time (``randattn.activations.lm_masks``).

The independent truth is transformers' own ``sdpa_mask`` building the whole N x M array, and SDPA run once on it:
the rows made on demand are that array's blocks, the classification of the described mask is the classification of
the whole array, and attention run a query block at a time on the keys each block sees equals attention run once.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
masking_utils = pytest.importorskip("transformers.masking_utils")

from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

from randattn.activations import lm_masks  # noqa: E402


def _arguments(batch: int, n: int, m: int, window: int, mask_function=None) -> dict:
    """What the mask interface passes for a sliding-window layer (create_sliding_window_causal_mask's call)."""
    return dict(batch_size=batch, q_length=n, kv_length=m, q_offset=m - n, kv_offset=0,
                mask_function=mask_function or masking_utils.sliding_window_causal_mask_function(window),
                attention_mask=None, local_size=window, allow_is_causal_skip=True, dtype=torch.float32,
                use_vmap=False, device="cpu")


def _whole(arguments: dict):
    return masking_utils.sdpa_mask(**{**arguments, "allow_is_causal_skip": False})


@pytest.mark.parametrize(("n", "m", "window"), [(37, 37, 5), (20, 45, 7), (9, 9, 9), (30, 30, 1)])
def test_rows_are_blocks_of_the_whole_mask(n, m, window):
    arguments = _arguments(2, n, m, window)
    whole = _whole(arguments)
    rows = lm_masks.capture_mask(**arguments)
    assert isinstance(rows, lm_masks.WindowRows) and rows.window == window
    for start, stop, lo, hi in [(0, n, 0, m), (0, 1, 0, 3), (3, 8, 2, 9), (n - 4, n, m - 9, m), (5, 6, 0, m)]:
        torch.testing.assert_close(rows.rows(start, stop, lo, hi), whole[..., start:stop, lo:hi], rtol=0, atol=0)


def test_fewer_keys_than_the_window_is_sdpas_own_answer():
    """Below W keys ``sdpa_mask`` skips to the is_causal shortcut (None); the registered function does the same."""
    arguments = _arguments(1, 6, 6, 8)
    assert masking_utils.sdpa_mask(**arguments) is None and lm_masks.capture_mask(**arguments) is None
    causal = dict(_arguments(1, 6, 6, 8), local_size=None, mask_function=masking_utils.causal_mask_function)
    assert lm_masks.capture_mask(**causal) is None


@pytest.mark.parametrize(("n", "m", "window", "kind"),
                         [(37, 37, 5, "sliding:5"), (20, 45, 7, "sliding:7"), (9, 9, 9, "causal"),
                          (30, 30, 1, "sliding:1")])
def test_the_described_mask_is_classified_as_the_whole_array_is(monkeypatch, n, m, window, kind):
    monkeypatch.setattr(lm_masks, "_CLASSIFY_ELEMENTS", 3 * m)  # blocks of three rows: a ragged last block
    arguments = _arguments(2, n, m, window)
    assert lm_masks.mask_kind(_whole(arguments), True, n, m) == kind
    assert lm_masks.mask_kind(lm_masks.capture_mask(**arguments), True, n, m) == kind


@pytest.mark.parametrize("overlay", ["sink", "hole", "shifted", "own-key"])
def test_a_window_its_mask_function_contradicts_is_refused_and_still_computed_whole(monkeypatch, overlay):
    """Key 0 visible to every query (an attention sink, outside the band for late rows), one key hidden inside the
    band, or one row's oldest key or its own traded for key 0: the pattern is no sliding window, so the capture refuses it, and the kernel, trusting no band, reads
    every key and gives the whole mask's attention."""
    monkeypatch.setattr(lm_masks, "_CLASSIFY_ELEMENTS", 4 * 40)
    monkeypatch.setattr(lm_masks, "QUERY_BLOCK", 8)
    window, n = 6, 40
    base = masking_utils.sliding_window_causal_mask_function(window)
    if overlay == "sink":
        function = masking_utils.or_masks(base, lambda b, h, q, kv: kv == 0)
    elif overlay in ("shifted", "own-key"):
        # row 28 (the first of a classification block) trades its band's oldest key for key 0, or row 31 (the
        # block's last) its own key: the count is right, one key of the band is not
        row, traded = (28, 28 - window + 1) if overlay == "shifted" else (31, 31)

        def function(b, h, q, kv):
            return (base(b, h, q, kv) & ~((q == row) & (kv == traded))) | ((q == row) & (kv == 0))
    else:
        function = masking_utils.and_masks(base, lambda b, h, q, kv: kv != 21)
    arguments = _arguments(1, n, n, window, function)
    rows = lm_masks.capture_mask(**arguments)
    with pytest.raises(lm_masks.MaskRefused, match="neither causal nor a causal sliding window"):
        lm_masks.mask_kind(rows, True, n, n)
    with pytest.raises(lm_masks.MaskRefused, match="neither causal nor a causal sliding window"):
        lm_masks.mask_kind(_whole(arguments), True, n, n)
    assert rows.key_span(32, 40) == (0, n)
    _assert_blocked_attention_is_whole_attention(rows, _whole(arguments))


@pytest.mark.parametrize(("n", "m", "window", "span"), [(70, 70, 6, (11, 32)), (50, 75, 9, (33, 57)),
                                                        (33, 33, 33, (0, 32))])
def test_attention_in_query_blocks_is_attention_on_the_whole_mask(monkeypatch, n, m, window, span):
    """Queries 16..31 of a window W see keys 16 + (M - N) - W + 1 .. 31 + (M - N); a window over every key is causal."""
    monkeypatch.setattr(lm_masks, "QUERY_BLOCK", 16)  # blocks of 16 queries, the last one ragged
    arguments = _arguments(2, n, m, window)
    rows = lm_masks.capture_mask(**arguments)
    assert rows.key_span(16, 32) == span
    _assert_blocked_attention_is_whole_attention(rows, _whole(arguments))


def _assert_blocked_attention_is_whole_attention(rows, whole):
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    b, n, m = whole.shape[0], whole.shape[-2], whole.shape[-1]
    g = torch.Generator().manual_seed(0)
    q = 2 * torch.randn(b, 4, n, 8, generator=g, dtype=torch.float64)  # logits of a few units: a wrong key shows
    k = 2 * torch.randn(b, 2, m, 8, generator=g, dtype=torch.float64)
    v = torch.randn(b, 2, m, 8, generator=g, dtype=torch.float64)
    expected, _ = sdpa_attention_forward(module, q, k, v, whole, scaling=0.3)
    got, weights = lm_masks.attention_in_query_blocks(sdpa_attention_forward, module, q, k, v, rows, scaling=0.3)
    assert weights is None and got.shape == expected.shape == (b, n, 4, 8)
    # float64: the blocks' softmax sums the same visible keys in another order, rounding of order 1e-16
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
