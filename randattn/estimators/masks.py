r"""Attention masks: the one rule of what a query may see (ARCHITECTURE sec. 12).

Under ``mask="causal"`` key m is visible to query n iff

.. math::
    m \le n + (M - N),

for N queries and M keys. With M == N this is the lower triangle with the diagonal (self-attention
of a decoder); with M > N the queries are the last N of M tokens, so each also sees the M - N keys
before them (decoding after a prompt). Every query sees at least key 0 when M >= N, so no row of
the mask is empty; M < N (queries before the first key) has no causal meaning and is refused.
"""

from __future__ import annotations

import numpy as np

__all__ = ["causal_visible", "check_causal_shapes", "last_visible_key"]


def check_causal_shapes(num_queries: int, num_keys: int) -> None:
    """Raise ValueError when N queries cannot be causal over M keys (M < N leaves rows with no key)."""
    if num_keys < num_queries:
        raise ValueError(
            f"a causal mask needs at least as many keys as queries (the queries are the last N of M tokens); "
            f"got N={num_queries} queries and M={num_keys} keys"
        )


def last_visible_key(num_queries: int, num_keys: int) -> np.ndarray:
    """``(N,)`` the last key index each query sees under the causal mask: ``n + (M - N)``."""
    check_causal_shapes(num_queries, num_keys)
    return np.arange(num_queries) + (num_keys - num_queries)


def causal_visible(num_queries: int, num_keys: int) -> np.ndarray:
    """``(N, M)`` boolean: True where key m is visible to query n (``m <= n + M - N``)."""
    last = last_visible_key(num_queries, num_keys)
    return np.arange(num_keys)[None, :] <= last[:, None]
