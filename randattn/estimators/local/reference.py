r"""Block-local exact attention (the sparse baseline of EVA app. E.1), numpy float64 (reference form).

Under ``mask="causal"`` each query attends to the visible keys of its block (the ``K x K``
lower-triangular mask of EVA app. D) and to the visible prefix keys; 1-D layouts only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.special import softmax

from randattn.estimators._prepare import prepare_reference
from randattn.estimators.base import Draws, keyword_entry
from randattn.estimators.eva.partition import (
    LayoutOptions,
    Partition,
    check_layout_params,
    check_mask_layout,
    eva_partition,
)

__all__ = ["estimate", "local_layout", "LocalOptions"]


@dataclass(frozen=True, kw_only=True)
class LocalOptions(LayoutOptions):
    """Local attention's keyword options: the windowed layout and ``mask``.

    Construction checks the layout and refuses ``mask="causal"`` on a grid
    (:func:`~randattn.estimators.eva.partition.check_mask_layout`) before any input is touched.
    """

    mask: str | None = None

    def check(self) -> None:
        super().check()
        check_mask_layout(self.mask, grid=self.resolved_grid)


def local_layout(num_queries: int, num_keys: int, window: int, prefix_tokens: int, grid: tuple[int, int] | None = None,
                 mask: str | None = None) -> Partition:
    """EVA's exact sets ``E^n`` (1-D blocks, or windows of ``grid``; under ``mask="causal"`` their visible
    keys); ValueError when some query would attend to no key or the mask has no meaning on the layout."""
    window, prefix_tokens = check_layout_params(window, prefix_tokens)
    check_mask_layout(mask, grid=grid)
    layout = eva_partition(num_queries, num_keys, window=window, prefix_tokens=prefix_tokens, num_chunks=1, grid=grid,
                           mask=mask, chunks=False)
    empty = [n for n, e in enumerate(layout.exact_keys) if len(e) == 0]
    if empty:
        raise ValueError(
            f"local attention needs every query to attend to some key, but with window={window} and "
            f"prefix_tokens={prefix_tokens} queries {empty[:5]}{'...' if len(empty) > 5 else ''} have an empty "
            "local block; use window >= 1 or prefix_tokens >= 1"
        )
    return layout


@keyword_entry(LocalOptions)
def estimate(q: Any, k: Any, v: Any, draws: Draws | None = None, *, options: LocalOptions) -> np.ndarray:
    r"""Softmax attention restricted to each query's local block (EVA's :math:`E^n` alone).

    .. math:: y_n = \sum_{m \in E^n} \frac{e^{x_n^\top y_m}}{\sum_{m' \in E^n} e^{x_n^\top y_{m'}}} v_m.

    Under ``mask="causal"``, :math:`E^n` is the visible part of the block of key :math:`n + M - N`
    (keys :math:`m \le n + M - N`; EVA app. D's ``K x K`` triangle) plus the visible prefix keys.

    Parameters
    ----------
    q, k, v : array_like
        Queries (..., N, D), keys (..., M, D), values (..., M, Dv).
    draws : Draws, optional
        Only its replicate count R is used (deterministic).
    scale : float, optional
    window : int
        Block size W (default 49, clipped to the sequence); the blocks, the N != M mapping and
        the prefix (CLS) keys are those of :mod:`randattn.estimators.eva.partition`.
    prefix_tokens : int
        Keys in every query's block; prefix queries attend to the prefix keys only.
    layout : {"grid", "sequence"}
        ``grid``: s x s windows of ``grid`` (``window = s^2``, 49 = 7x7) when a grid is given.
    grid : (h, w), "HxW" or None
        Patch grid of the body tokens; None = 1-D blocks.
    mask : {None, "causal"}
        ``"causal"``: key m visible to query n iff ``m <= n + M - N`` (needs M >= N); ValueError
        with a grid layout (a 2-D window has no causal meaning).

    Returns
    -------
    (R, ..., N, Dv) with draws, else (..., N, Dv).

    Notes
    -----
    Equals softmax attention when the block covers every key (``window >= M - prefix_tokens``
    and no prefix query without a block). Cost ``O(N W (D + Dv))``.

    Examples
    --------
    >>> import numpy as np
    >>> from randattn.estimators.local.reference import estimate
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.normal(size=(3, 16, 8))
    >>> estimate(q, k, v, window=4).shape
    (16, 8)
    """
    x, y, v, _, _ = prepare_reference(q, k, v, options.scale)
    parts = local_layout(x.shape[-2], y.shape[-2], options.window, options.prefix_tokens, options.resolved_grid,
                         options.mask)
    last = parts.last_visible  # (N,) t_n under the causal mask, else None
    out = np.empty((*x.shape[:-1], v.shape[-1]))
    for qi, exact in parts.blocks():
        logits = x[..., qi, :] @ np.swapaxes(y[..., exact, :], -1, -2)
        if last is not None:  # the block's keys after t_n are hidden
            logits = np.where(exact[None, :] <= last[qi][:, None], logits, -np.inf)
        p = softmax(logits, axis=-1)
        out[..., qi, :] = p @ v[..., exact, :]
    if draws is None:
        return out
    return np.broadcast_to(out, (draws.replicates, *out.shape)).copy()
