"""The attention masks of a language-model capture, and a sliding window held a block of query rows at a time.

``transformers`` builds each layer's mask through ``AttentionMaskInterface`` under the attention implementation's
name (:mod:`randattn.activations.lm`). SDPA's own mask function, ``sdpa_mask``, hands ``None`` for a plain causal
mask (the kernel's ``is_causal`` path, no N x N array) but materialises a sliding window as a boolean N x M array:
1 GiB at 32,768 tokens and 16 GiB at 131,072, before the arrays that classify it. :func:`capture_mask` is
``sdpa_mask`` except there: a sliding window over at least W keys becomes a :class:`WindowRows`, a description
whose rows ``sdpa_mask`` itself makes on demand, for a block of queries and the keys the block can see. So the mask's
values stay the model's own, and :func:`attention_in_query_blocks` runs the kernel block by block on those keys only:
O(N (W + B)) work and O(B (W + B)) mask per block, with B = :data:`QUERY_BLOCK` queries.

:func:`mask_kind` names what the kernel gets: ``None`` (no mask), ``"causal"`` or ``"sliding:W"`` (the convention of
:mod:`randattn.activations.io`), and refuses any other pattern. A :class:`WindowRows` is read whole for that, once
and a block of rows at a time (O(N M) time; about 1 MiB of mask at once), since a window the kernel trusts but the mask
function contradicts (padding, packed sequences, an extra mask function) would be captured wrong.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["QUERY_BLOCK", "MaskRefused", "WindowRows", "capture_mask", "mask_kind", "attention_in_query_blocks"]

#: queries per kernel call for a sliding window: each call reads at most QUERY_BLOCK + W - 1 keys
QUERY_BLOCK = 1024
#: mask elements per block of rows read by the classification (1 MiB of booleans: the sums stay in cache)
_CLASSIFY_ELEMENTS = 1 << 20


class MaskRefused(ValueError):
    """The mask is not one that softmax(scale q k^T) restricted to a causal or sliding-window pattern reproduces."""


class WindowRows:
    """A sliding-window mask described, not materialised: rows come from ``sdpa_mask`` with the model's arguments.

    Parameters
    ----------
    window : int
        The layer's sliding window W (``local_size`` of the mask interface).
    arguments : dict
        Every argument the mask interface passed (``batch_size``, ``q_length``, ``kv_length``, ``mask_function``,
        offsets, padding, ...); :meth:`rows` re-issues them for a block of queries and keys.
    """

    def __init__(self, window: int, arguments: dict[str, Any]) -> None:
        self.window = int(window)
        self.arguments = dict(arguments)
        self.q_length = int(arguments["q_length"])
        self.kv_length = int(arguments["kv_length"])

    def __repr__(self) -> str:
        return f"WindowRows(window={self.window}, q_length={self.q_length}, kv_length={self.kv_length})"

    def rows(self, start: int, stop: int, kv_start: int = 0, kv_stop: int | None = None):
        """``(B, 1, stop - start, kv_stop - kv_start)`` bool: rows ``start:stop``, keys ``kv_start:kv_stop``.

        The mask's rows and columns are positions ``q_offset + n`` and ``kv_offset + m``, so shifting both offsets
        gives exactly that block of the mask ``sdpa_mask`` would have built whole.
        """
        from transformers.masking_utils import sdpa_mask

        kv_stop = self.kv_length if kv_stop is None else kv_stop
        arguments = {**self.arguments, "q_length": stop - start, "kv_length": kv_stop - kv_start,
                     "q_offset": self.arguments.get("q_offset", 0) + start,
                     "kv_offset": self.arguments.get("kv_offset", 0) + kv_start,
                     "allow_is_causal_skip": False, "allow_is_bidirectional_skip": False}
        return sdpa_mask(**arguments)

    def row_blocks(self) -> Iterator[tuple[int, Any]]:
        """``(start, rows)`` over the whole mask, about :data:`_CLASSIFY_ELEMENTS` elements a block."""
        size = max(1, _CLASSIFY_ELEMENTS // max(1, self.kv_length))
        for start in range(0, self.q_length, size):
            yield start, self.rows(start, min(self.q_length, start + size))

    @functools.cached_property
    def kind_or_refusal(self) -> tuple[str | None, str | None]:
        """``(kind, None)`` when the whole mask is one pattern :func:`mask_kind` accepts, else ``(None, reason)``."""
        try:
            return _classify(self.row_blocks(), self.q_length, self.kv_length, self.window), None
        except MaskRefused as exc:
            return None, str(exc)

    def key_span(self, start: int, stop: int) -> tuple[int, int]:
        """The keys ``[lo, hi)`` that queries ``start:stop`` may see; every key when the pattern is not known."""
        kind, _ = self.kind_or_refusal
        shift = self.kv_length - self.q_length  # key m visible to query n iff m <= n + (M - N) (io, section 12)
        if kind is None:
            return 0, self.kv_length
        # a causal kind means a window over every key, where this lower end is 0
        return max(0, start + shift - self.window + 1), min(self.kv_length, stop + shift)


def capture_mask(**arguments: Any):
    """The registered mask function: ``sdpa_mask``, except that a sliding window is never materialised.

    ``sdpa_mask`` skips a sliding window's mask only when the keys are fewer than the window
    (``_ignore_causal_mask_sdpa``), and then every key inside the window is a causal key; from W keys on it would
    build the N x M array, and a :class:`WindowRows` stands in for it.
    """
    from transformers.masking_utils import sdpa_mask

    window = arguments.get("local_size")
    if window is None or arguments["kv_length"] < window:
        return sdpa_mask(**arguments)
    return WindowRows(window, arguments)


def mask_kind(mask: Any, causal: bool, n: int, m: int) -> str | None:
    """Classify the mask the kernel gets: None (none), ``"causal"`` or ``"sliding:W"``; raise for anything else.

    Raises
    ------
    MaskRefused
        The mask adds values other than 0 and -inf, differs between sequences or heads, or is neither causal nor
        a causal sliding window.
    """
    import torch

    if mask is None:
        # SDPA then applies is_causal (for more than one query); nothing else is masked
        return "causal" if causal and n > 1 else None
    if isinstance(mask, WindowRows):
        kind, refusal = mask.kind_or_refusal
        if refusal is not None:
            raise MaskRefused(refusal)
        return kind
    if mask.dtype == torch.bool:
        allowed = mask
    else:
        allowed = mask == 0
        blocked = mask <= torch.finfo(mask.dtype).min / 2
        if not bool((allowed | blocked).all()):
            raise MaskRefused(
                "the attention mask adds values other than 0 and -inf to the logits (a position bias such as "
                "ALiBi), which softmax(scale q k^T) with a causal or sliding-window mask does not reproduce"
            )
    window = int(allowed.sum(-1).max())
    return _classify(iter([(0, allowed)]), n, m, window)


def _classify(blocks: Iterator[tuple[int, Any]], n: int, m: int, window: int) -> str | None:
    """None, ``"causal"`` or ``"sliding:window"`` for a mask given as ``(first row, (..., rows, m) bool)`` blocks.

    Row n of a sliding window shows exactly the keys ``lo_n..hi_n``, ``hi_n = n + M - N`` (io, section 12) and
    ``lo_n = max(0, hi_n - window + 1)``: its count of visible keys is ``hi_n - lo_n + 1`` and every key of the band
    is visible. Those two facts read each row once and the band alone, not an N x M pattern; a window that covers
    every key is the causal mask.
    """
    import torch

    every = sliding = True
    for start, block in blocks:
        allowed = block.reshape(-1, block.shape[-2], block.shape[-1])  # on the model's device: read, not moved
        if allowed.shape[0] > 1 and not bool((allowed == allowed[:1]).all()):
            raise MaskRefused("the attention mask differs between sequences or heads (padding?); it is not one "
                              "causal or sliding-window pattern")
        a = allowed[0]
        counts = a.sum(-1)
        every = every and bool((counts == m).all())
        if sliding:
            hi = torch.arange(start, start + a.shape[0], device=a.device) + (m - n)
            lo = (hi - window + 1).clamp(min=0)
            # the band's columns from host integers (lo and hi grow with the row): no read-back from a device
            first, stop = max(0, start + m - n - window + 1), max(start + a.shape[0] + m - n, 0)
            cols = torch.arange(first, stop, device=a.device)[None, :]
            band = (cols >= lo[:, None]) & (cols <= hi[:, None])
            sliding = (torch.equal(counts, (hi - lo + 1).clamp(min=0))
                       and bool((a[:, first:stop] | ~band).all()))
    if every:
        return None
    if sliding:
        return "causal" if window >= m else f"sliding:{window}"
    raise MaskRefused("the attention mask is neither causal nor a causal sliding window")


def attention_in_query_blocks(kernel: Callable, module: Any, query: Any, key: Any, value: Any, mask: WindowRows,
                              **kwargs: Any) -> tuple[Any, None]:
    """``kernel`` run on :data:`QUERY_BLOCK` queries at a time, each on the keys its rows of ``mask`` may see.

    ``query`` is ``(B, H, N, D)``, ``key`` and ``value`` ``(B, Hkv, M, D)``; ``kernel`` is transformers' SDPA
    attention function, which returns ``((B, N, H, D), weights)``. Each block's softmax runs over the same visible
    keys as the whole mask's row (the keys left out are masked there), so only float rounding differs.
    """
    import torch

    outputs = []
    for start in range(0, mask.q_length, QUERY_BLOCK):
        stop = min(mask.q_length, start + QUERY_BLOCK)
        lo, hi = mask.key_span(start, stop)
        out, _ = kernel(module, query[:, :, start:stop], key[:, :, lo:hi], value[:, :, lo:hi],
                        mask.rows(start, stop, lo, hi), **kwargs)
        outputs.append(out)
    return torch.cat(outputs, dim=1), None
