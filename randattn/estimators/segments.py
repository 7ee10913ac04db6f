"""Contiguous segments of a token sequence and their means (landmarks), numpy and torch.

Segments follow ``numpy.array_split``: a length-T sequence in C segments has the first
``T mod C`` segments one token longer (N = 197, C = 49: 1 segment of 5 tokens, 48 of 4).
C larger than T degrades gracefully to T segments of one token.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from randattn._validation import check_positive_int

__all__ = ["segment_bounds", "effective_segments", "pooling_matrix", "segment_means", "segment_means_torch"]


def effective_segments(length: int, num_segments: int) -> int:
    """``min(C, T)``: more segments than tokens would leave some empty."""
    check_positive_int("num_segments", num_segments)
    check_positive_int("length", length)
    return min(num_segments, length)


def segment_bounds(length: int, num_segments: int) -> np.ndarray:
    """Offsets ``(C_eff + 1,)`` of contiguous segments, sizes differing by at most one."""
    c = effective_segments(length, num_segments)
    base, extra = divmod(length, c)
    sizes = np.full(c, base, dtype=np.int64)
    sizes[:extra] += 1
    return np.concatenate([[0], np.cumsum(sizes)])


def pooling_matrix(length: int, num_segments: int) -> np.ndarray:
    """``(C_eff, T)`` averaging matrix: row c holds ``1/|segment c|`` on its tokens."""
    bounds = segment_bounds(length, num_segments)
    pool = np.zeros((len(bounds) - 1, length))
    for c, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        pool[c, lo:hi] = 1.0 / (hi - lo)
    return pool


def segment_means(x: np.ndarray, num_segments: int) -> np.ndarray:
    """Landmarks ``(..., C_eff, D)``: the mean of each contiguous segment of ``x : (..., T, D)`` (LARA G.3.1)."""
    return pooling_matrix(x.shape[-2], num_segments) @ x


def segment_means_torch(x: Any, num_segments: int) -> Any:
    """torch form of :func:`segment_means` (same segments, same layout)."""
    import torch

    pool = torch.as_tensor(pooling_matrix(x.shape[-2], num_segments), dtype=x.dtype, device=x.device)
    return pool @ x
