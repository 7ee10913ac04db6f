r"""Scatterbrain (Chen et al., NeurIPS 2021) as written in EVA app. G.5, numpy float64 (reference form)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.special import logsumexp, softmax

from randattn.estimators._prepare import check_draw_array, prepare_reference
from randattn.estimators.base import Draws, keyword_entry
from randattn.estimators.eva.partition import LayoutOptions, check_mask_layout, eva_partition
from randattn.estimators.features.reference import positive_log_features
from randattn.estimators.rfa.options import coupling_option
from randattn.estimators.snis.reference import feature_attention

__all__ = ["estimate", "ScatterbrainOptions"]


@dataclass(frozen=True, kw_only=True)
class ScatterbrainOptions(LayoutOptions):
    """Scatterbrain's keyword options: the windowed layout, RFA's ``coupling`` (used by ``draw`` only), ``mask``.

    Construction checks the layout and refuses ``mask="causal"`` on a grid
    (:func:`~randattn.estimators.eva.partition.check_mask_layout`) before any input is touched.
    """

    coupling: str = coupling_option()
    mask: str | None = None

    def check(self) -> None:
        super().check()
        check_mask_layout(self.mask, grid=self.resolved_grid)


@keyword_entry(ScatterbrainOptions)
def estimate(q: Any, k: Any, v: Any, draws: Draws, options: ScatterbrainOptions) -> np.ndarray:
    r"""Scatterbrain: random features off the local support, exact scores on it, renormalized (EVA eq. 29-30).

    .. math::
        y_n = \frac{\sum_{m \notin E^n} \phi(x_n)^\top \phi(y_m) v_m + \sum_{m \in E^n} e^{x_n^\top y_m} v_m}
                   {\sum_{m \notin E^n} \phi(x_n)^\top \phi(y_m) + \sum_{m \in E^n} e^{x_n^\top y_m}},
        \qquad \phi(x)^\top \phi(y) = \frac1S \sum_s \xi(x, \omega_s) \xi(y, \omega_s),

    with positive features :math:`\xi(x, \omega) = \exp(\omega^\top x - \|x\|^2/2)`,
    :math:`\omega_s \sim \mathcal N(0, I)` and the support :math:`E^n` = EVA's local block plus
    prefix keys (:mod:`randattn.estimators.eva.partition`; Scatterbrain's sparse part is the
    local attention, EVA app. E.1). Computed in log space: the off-support sum is
    :math:`W_n \cdot \mathrm{RFA}_{m \notin E^n}(x_n)` with
    :math:`\log W_n = \mathrm{logsumexp}_s(\log\xi(x_n, \omega_s) + \mathrm{logsumexp}_{m \notin E^n} \log\xi(y_m, \omega_s)) - \log S`,
    combined with the exact logits by one softmax.

    Under ``mask="causal"`` both sums run over the visible keys :math:`m \le n + M - N` only:
    the support is the visible part of the block (EVA app. D's ``K x K`` triangle) plus the
    visible prefix keys, and the random features cover the body keys before the block, which lie
    wholly before the support (the structure of causal EVA, :mod:`randattn.estimators.eva.partition`).

    Parameters
    ----------
    q, k, v : array_like
        Queries (..., N, D), keys (..., M, D), values (..., M, Dv).
    draws : Draws
        ``omega : (R, ..., S, D)`` from :func:`randattn.estimators.scatterbrain.draw`, shared by all blocks.
    scale : float, optional
    window : int
        Local block size W >= 0 (default 49, clipped to the sequence).
    prefix_tokens : int
        Keys on every query's support (CLS).
    layout : {"grid", "sequence"}
        ``grid``: s x s windows of ``grid`` (``window = s^2``, 49 = 7x7) when a grid is given.
    grid : (h, w), "HxW" or None
        Patch grid of the body tokens; None = 1-D blocks.
    coupling : str
        Only used by ``draw``.
    mask : {None, "causal"}
        ``"causal"``: key m visible to query n iff ``m <= n + M - N`` (needs M >= N); ValueError
        with a grid layout (a 2-D window has no causal meaning). Same draws as without the mask.

    Returns
    -------
    (R, ..., N, Dv)

    Notes
    -----
    Equal, with the same omega, to EVA with C = 1, ``proposal_mean="standard"``,
    ``samples_per_chunk=S`` and ``chunk_weight="rfa"`` (EVA app. G.5). Cost
    ``O(N W (D + Dv) + G M S D + N S Dv)`` with G the number of local blocks.

    Examples
    --------
    >>> import numpy as np
    >>> from randattn.estimators import scatterbrain
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.normal(size=(3, 16, 8))
    >>> draws = scatterbrain.draw(q.shape, k.shape, num_samples=32, replicates=2, rng=rng)
    >>> scatterbrain.reference.estimate(q, k, v, draws, window=4).shape
    (2, 16, 8)
    """
    x, y, v, _, batch = prepare_reference(q, k, v, options.scale)
    omega = check_draw_array(draws, "omega", batch, (None, x.shape[-1]))
    num_q, num_k = x.shape[-2], y.shape[-2]
    lead = (draws.replicates, *batch)
    parts = eva_partition(
        num_q, num_k, window=options.window, prefix_tokens=options.prefix_tokens, num_chunks=1, partition="paper",
        grid=options.resolved_grid, mask=options.mask, chunks=False,
    )
    last = parts.last_visible  # (N,) t_n under the causal mask, else None
    out = np.empty((*lead, num_q, v.shape[-1]))
    for qi, exact in parts.blocks():
        e_logits = x[..., qi, :] @ np.swapaxes(y[..., exact, :], -1, -2)
        if last is None:
            rest = np.setdiff1d(np.arange(num_k), exact)  # m not in Supp_n(S)
        else:
            # the visible keys off the support: those before t_n of the cell's first query that are not in E
            # (the body keys before the block; the block's later keys are in E, masked per query below)
            rest = np.setdiff1d(np.arange(last[qi[0]] + 1), exact)
            e_logits = np.where(exact[None, :] <= last[qi][:, None], e_logits, -np.inf)
        e_logits = np.broadcast_to(e_logits[None], (*lead, len(qi), len(exact)))
        if len(rest) == 0:
            out[..., qi, :] = softmax(e_logits, axis=-1) @ v[None, ..., exact, :]
            continue
        log_qf, _ = positive_log_features(x[None, ..., qi, :], omega)  # (R, ..., n_b, S, 1)
        log_kf, _ = positive_log_features(y[None, ..., rest, :], omega)  # (R, ..., |rest|, S, 1)
        rfa_rest, _ = feature_attention(log_qf, log_kf, v[None, ..., rest, :])  # (R, ..., n_b, Dv)
        log_w = logsumexp(log_qf[..., 0] + logsumexp(log_kf[..., 0], axis=-2)[..., None, :], axis=-1) - np.log(omega.shape[-2])
        p = softmax(np.concatenate([e_logits, log_w[..., None]], axis=-1), axis=-1)
        out[..., qi, :] = p[..., :-1] @ v[None, ..., exact, :] + p[..., -1:] * rfa_rest
    return out
