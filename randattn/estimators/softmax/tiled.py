r"""Exact softmax attention by tiles: the flash recurrence in float64, memory O(N Dv + Tq Tk).

The truth of a long-context measurement (ARCHITECTURE sec. 14) without the N x M score matrix:
the keys are taken a tile of :math:`T_k` at a time, for a tile of :math:`T_q` queries at a time,
and every query keeps a running maximum, a running normaliser and a running (unnormalised) output.

For one query n with logits :math:`s_{nm} = \mathrm{scale}\; q_n^\top k_m` over its visible keys
:math:`V_n` (every key, or under ``mask="causal"`` the keys :math:`m \le n + M - N`,
:mod:`randattn.estimators.masks`), after key tiles :math:`K_1, \dots, K_t`:

.. math::
    \mu^{(t)}_n &= \max\big(\mu^{(t-1)}_n,\ \max_{m \in K_t \cap V_n} s_{nm}\big), \\
    \ell^{(t)}_n &= e^{\mu^{(t-1)}_n - \mu^{(t)}_n}\, \ell^{(t-1)}_n
                   + \sum_{m \in K_t \cap V_n} e^{s_{nm} - \mu^{(t)}_n}, \\
    a^{(t)}_n &= e^{\mu^{(t-1)}_n - \mu^{(t)}_n}\, a^{(t-1)}_n
                   + \sum_{m \in K_t \cap V_n} e^{s_{nm} - \mu^{(t)}_n}\, v_m,

from :math:`\mu^{(0)} = -\infty`, :math:`\ell^{(0)} = 0`, :math:`a^{(0)} = 0`; after the last tile
T, :math:`y_n = a^{(T)}_n / \ell^{(T)}_n` and the log-normaliser is

.. math:: \log Z_n = \log \sum_{m \in V_n} e^{s_{nm}} = \mu^{(T)}_n + \log \ell^{(T)}_n .

Every exponent is at most 0 (the running maximum bounds every logit seen so far), so nothing
overflows however large the logits; the first tile holds key 0, which every query sees, so
:math:`\mu^{(1)}_n` is finite and :math:`\ell^{(T)}_n \ge 1` (its maximum term is :math:`e^0`): no
epsilon, no 0/0. A hidden logit is set to :math:`-\infty` before the maximum, so its weight is an
exact 0 and keys a query may not see change none of its bits.

The exact probabilities of any (query tile, key tile) block are formed again on demand from the
log-normaliser, :math:`p_{nm} = e^{s_{nm} - \log Z_n}` (:func:`tiled_probabilities`): every metric
of ARCHITECTURE sec. 14 is then a sum over blocks.

References
----------
Milakov & Gimelshein, "Online normalizer calculation for softmax", arXiv 1805.02867, 2018 (Alg. 3:
the running maximum and normaliser in one pass). Dao et al., "FlashAttention: fast and memory-efficient
exact attention with IO-awareness", NeurIPS 2022, Algorithm 1 (the recurrence over key tiles with the
output rescaled by :math:`e^{\mu_{old} - \mu_{new}}`; here the output is kept unnormalised and divided
once at the end, as in FlashAttention-2, Dao 2023, Alg. 1).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from randattn._validation import check_choice, check_finite, check_positive_int, check_qkv_shapes, check_scale
from randattn.estimators.masks import DECLARABLE_MASKS, Mask, check_causal_shapes, check_mask_argument

__all__ = ["DEFAULT_KEY_TILE", "DEFAULT_QUERY_TILE", "tiled_attention", "tiled_probabilities"]

#: Tiles of 256 queries x 1024 keys: a block costs 2 Tq Tk (D + Dv) ~ 67 MFLOP per batch element at D = Dv = 64,
#: far more than the ~10 torch calls of Python overhead per block (tens of microseconds), so the loop over
#: (N / Tq)(M / Tk) blocks costs little. The block's logits are Tq Tk 8 bytes = 2 MiB per batch element in float64,
#: and every batch element (head) of a unit is in one block: with 9 heads, 1024 x 1024 tiles (72 MiB of logits per
#: block) left the cache on each of the block's elementwise passes and were 1.9x slower (9 heads x 8,192 tokens,
#: causal, 2-core CPU: 6.3 s against 3.2 s; one head 1.4 s against 1.6 s). Each query's recurrence runs over the
#: same key tiles whatever Tq, so Tq changes no log-normaliser and the output only by the products' rounding.
DEFAULT_QUERY_TILE = 256
DEFAULT_KEY_TILE = 1024

#: the precisions of the recurrence: float64 (the truth) or float32 (allowed, e.g. on an accelerator)
DTYPES = (torch.float64, torch.float32)


def _as_tensor(array: Any) -> torch.Tensor:
    """A torch tensor of ``array`` (numpy arrays without a copy; tensors as they are)."""
    return array if isinstance(array, torch.Tensor) else torch.as_tensor(np.asarray(array))


def _check_tiles(query_tile: Any, key_tile: Any) -> tuple[int, int]:
    return check_positive_int("query_tile", query_tile), check_positive_int("key_tile", key_tile)


def _hidden_block(n0: int, n1: int, k0: int, k1: int, offset: int, device: torch.device,
                  window: int | None = None) -> torch.Tensor | None:
    """``(n1 - n0, k1 - k0)`` boolean, True where key m is hidden from query n: m > n + offset (offset = M - N),
    or, with a sliding ``window`` W, m <= n + offset - W.

    None when the block is wholly visible (its last key is visible to its first query, and its first key to its
    last query), so that the blocks inside the band take no mask at all.
    """
    after = k1 - 1 > n0 + offset
    before = window is not None and k0 <= n1 - 1 + offset - window
    if not (after or before):
        return None
    # hidden iff k0 + j > n0 + i + offset iff j - i >= n0 + offset - k0 + 1: an upper triangle from that diagonal
    hidden = torch.ones(n1 - n0, k1 - k0, dtype=torch.bool, device=device).triu_(n0 + offset - k0 + 1)
    if before:
        # hidden iff k0 + j <= n0 + i + offset - W iff j - i <= n0 + offset - W - k0: a lower triangle
        hidden |= torch.ones(n1 - n0, k1 - k0, dtype=torch.bool, device=device).tril_(n0 + offset - window - k0)
    return hidden


def tiled_attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    scale: float | None = None,
    mask: str | None = None,
    query_tile: int = DEFAULT_QUERY_TILE,
    key_tile: int = DEFAULT_KEY_TILE,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Exact softmax attention and each query's log-normaliser, by tiles (the flash recurrence).

    .. math::
        y_n = \frac{\sum_{m \in V_n} e^{s_{nm}} v_m}{\sum_{m \in V_n} e^{s_{nm}}}, \qquad
        \log Z_n = \log \sum_{m \in V_n} e^{s_{nm}}, \qquad s_{nm} = \mathrm{scale}\; q_n^\top k_m,

    computed with the running maximum and normaliser of the module docstring over key tiles of
    ``key_tile`` keys, for query tiles of ``query_tile`` queries in turn. Under ``mask="causal"``
    (:math:`V_n = \{m \le n + M - N\}`) a key tile wholly hidden from a query tile is skipped (no work),
    and only the tiles the diagonal crosses are masked. Under ``mask="sliding:W"`` (the last W of those keys) the
    key tiles of a query tile start at its first query's first key, :math:`n_0 + M - N - W + 1`: its work is
    :math:`O(T_q (W + T_q))` keys, whatever M.

    Parameters
    ----------
    q : (..., N, D) numpy array or torch tensor
    k : (..., M, D)
    v : (..., M, Dv)
        The same leading (batch) dims, e.g. heads; tensors stay on their device.
    scale : float, optional
        Temperature; default ``D ** -0.5`` (the logits are ``scale * q.k``, as ``softmax.batched``).
    mask : {None, "causal", "sliding:W"}
        A mask requires M >= N (the queries are the last N of the M tokens).
    query_tile, key_tile : int
        Tile sizes Tq, Tk >= 1 (larger than N or M means one tile). See ``DEFAULT_QUERY_TILE``.
    dtype : torch.float64 or torch.float32
        The precision of the recurrence; each tile of q, k, v is converted as it is used, so a
        float32 input is never copied whole.

    Returns
    -------
    out : (..., N, Dv) tensor of ``dtype``
    log_normaliser : (..., N) tensor of ``dtype``
        :math:`\log Z_n`, for :func:`tiled_probabilities`.

    Raises
    ------
    ValueError
        Shapes that disagree, a tile size < 1, an unknown mask, a ``dtype`` other than float64/float32,
        M < N under ``mask="causal"``, or NaN/inf inputs (on the CPU), before any work.
    TypeError
        A non-floating input or a non-integer tile size.

    Notes
    -----
    Memory beyond the inputs: the output and three running states, :math:`(N D_v + 2N)` numbers, plus
    one block of :math:`T_q T_k` logits (and, on diagonal blocks, a :math:`T_q T_k` boolean mask) and
    :math:`T_q (D + D_v)` for the query tile -- per batch element, all batch elements at once. Never an
    N x M array. Time :math:`O(N M (D + D_v))`, about half of it under the causal mask, and
    :math:`O(N (W + T_q + T_k) (D + D_v))` under a sliding window.

    References
    ----------
    Dao et al. 2022 (FlashAttention), Algorithm 1; Milakov & Gimelshein 2018 (online softmax), Alg. 3.

    Examples
    --------
    >>> import torch
    >>> g = torch.Generator().manual_seed(0)
    >>> q, k, v = (torch.randn(2, n, 8, generator=g, dtype=torch.float64) for n in (5, 9, 9))
    >>> out, lse = tiled_attention(q, k, v, mask="causal", query_tile=2, key_tile=3)
    >>> out.shape, lse.shape
    (torch.Size([2, 5, 8]), torch.Size([2, 5]))
    """
    check_mask_argument(mask, DECLARABLE_MASKS)
    check_choice("dtype", dtype, DTYPES)
    _, n, m, dim, dv = check_qkv_shapes(q, k, v)
    scale = check_scale(scale, dim)
    query_tile, key_tile = _check_tiles(query_tile, key_tile)
    offset = m - n  # key j is visible to query i iff j <= i + offset (and, with a window W, j > i + offset - W)
    window = Mask.parse(mask).window
    if mask is not None:
        check_causal_shapes(n, m)
    q, k, v = _as_tensor(q), _as_tensor(k), _as_tensor(v)
    batch = q.shape[:-2]
    out = torch.empty((*batch, n, dv), dtype=dtype, device=q.device)
    log_normaliser = torch.empty((*batch, n), dtype=dtype, device=q.device)
    for n0 in range(0, n, query_tile):
        n1 = min(n0 + query_tile, n)
        # scale folded into the query tile once: Tq D multiplications instead of Tq M
        q_tile = q[..., n0:n1, :].to(dtype) * scale
        running_max = torch.full((*batch, n1 - n0), -torch.inf, dtype=dtype, device=q.device)
        running_sum = torch.zeros((*batch, n1 - n0), dtype=dtype, device=q.device)
        acc = torch.zeros((*batch, n1 - n0, dv), dtype=dtype, device=q.device)
        # causal: the key tiles starting after the tile's last query's last key (n1 - 1 + offset) are hidden; a
        # window: so are the keys before its first query's first key (n0 + offset - W + 1)
        key_end = m if mask is None else n1 + offset
        key_start = 0 if window is None else max(n0 + offset - window + 1, 0)
        for k0 in range(key_start, key_end, key_tile):
            k1 = min(k0 + key_tile, key_end)
            logits = q_tile @ k[..., k0:k1, :].to(dtype).transpose(-1, -2)
            hidden = None if mask is None else _hidden_block(n0, n1, k0, k1, offset, q.device, window)
            if hidden is not None:
                logits.masked_fill_(hidden, -torch.inf)
            # a row wholly hidden in this block has max -inf; the new maximum is then the old one, finite after
            # the first tile, which holds key 0 (causal) -- under a window a later query's first tile may hide
            # its whole row: a maximum still -inf is shifted by 0 there, not by itself (no exp(-inf - -inf)), and
            # stays -inf as the running maximum
            new_max = torch.maximum(running_max, logits.amax(dim=-1))
            shift = new_max if window is None else torch.where(torch.isinf(new_max), 0.0, new_max)
            rescale = torch.exp(running_max - shift)  # exp(-inf) = 0 on the first tile
            weights = logits.sub_(shift.unsqueeze(-1)).exp_()
            running_sum.mul_(rescale).add_(weights.sum(dim=-1))
            acc.mul_(rescale.unsqueeze(-1)).add_(weights @ v[..., k0:k1, :].to(dtype))
            running_max = new_max
            del logits, weights, hidden
        out[..., n0:n1, :] = acc.div_(running_sum.unsqueeze(-1))
        log_normaliser[..., n0:n1] = running_max + running_sum.log()
    return out, log_normaliser


def _check_slice(name: str, value: Any, size: int) -> tuple[int, int]:
    """``(start, stop)`` of a step-1 slice of ``range(size)`` holding at least one index."""
    if not isinstance(value, slice):
        raise TypeError(f"{name} must be a slice, got {type(value).__name__} {value!r}")
    start, stop, step = value.indices(size)
    if step != 1:
        raise ValueError(f"{name}={value!r} must have step 1, got step {step}")
    if stop <= start:
        raise ValueError(f"{name}={value!r} selects no index of {size}")
    return start, stop


def tiled_probabilities(
    q: Any,
    k: Any,
    log_normaliser: torch.Tensor,
    *,
    query_slice: slice,
    key_slice: slice,
    scale: float | None = None,
    mask: str | None = None,
) -> torch.Tensor:
    r"""The exact attention probabilities of one (query tile, key tile) block, from the log-normaliser.

    .. math:: p_{nm} = e^{\mathrm{scale}\; q_n^\top k_m - \log Z_n} \text{ for } m \in V_n, \qquad 0 \text{ otherwise},

    for n in ``query_slice`` and m in ``key_slice``, with :math:`\log Z_n` from :func:`tiled_attention`
    (same q, k, scale and mask). Each exponent is at most 0 up to rounding, so nothing overflows.

    Parameters
    ----------
    q : (..., N, D)
    k : (..., M, D)
    log_normaliser : (..., N) tensor
        From :func:`tiled_attention`; the block is computed in its dtype, on its device.
    query_slice, key_slice : slice
        Step-1 slices of range(N) and range(M) (negative and open ends as in Python).
    scale : float, optional
        Temperature; default ``D ** -0.5``.
    mask : {None, "causal", "sliding:W"}

    Returns
    -------
    (..., Tq, Tk) tensor: the block's probabilities; over all key blocks each row sums to 1.

    Raises
    ------
    ValueError
        Shapes that disagree (the log-normaliser's included), an empty or strided slice, an unknown mask,
        M < N under ``mask="causal"``, NaN or inf in the rows of q or k that the block reads (on the CPU).
    """
    check_mask_argument(mask, DECLARABLE_MASKS)
    k_values = k[..., :1]  # a view standing in for v: check_qkv_shapes checks q and k (and the batch dims)
    # shapes here, values below: only the block's rows are read, and a pass over M / Tk key tiles that read all
    # of k on each call did O(M^2 / Tk) work (72 s of 80 at 113,108 keys)
    batch, n, m, dim, _ = check_qkv_shapes(q, k, k_values, values=False)
    scale = check_scale(scale, dim)
    if mask is not None:
        check_causal_shapes(n, m)
    log_normaliser = _as_tensor(log_normaliser)
    if tuple(log_normaliser.shape) != (*batch, n):
        raise ValueError(f"log_normaliser must have shape (..., N) = {(*batch, n)} to match q {tuple(q.shape)}, "
                         f"got {tuple(log_normaliser.shape)}")
    check_choice("log_normaliser dtype", log_normaliser.dtype, DTYPES)
    n0, n1 = _check_slice("query_slice", query_slice, n)
    k0, k1 = _check_slice("key_slice", key_slice, m)
    check_finite(q=q[..., n0:n1, :], k=k[..., k0:k1, :])
    dtype = log_normaliser.dtype
    q, k = _as_tensor(q), _as_tensor(k)
    logits = (q[..., n0:n1, :].to(dtype) * scale) @ k[..., k0:k1, :].to(dtype).transpose(-1, -2)
    if mask is not None:
        hidden = _hidden_block(n0, n1, k0, k1, m - n, log_normaliser.device, Mask.parse(mask).window)
        if hidden is not None:
            logits.masked_fill_(hidden, -torch.inf)
    return logits.sub_(log_normaliser[..., n0:n1].unsqueeze(-1)).exp_()
