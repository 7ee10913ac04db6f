r"""The ground truth of a unit: its heads' inputs and exact attention, cached per image-layer (issue #26).

:func:`exact_attention` computes the exact float64 softmax probabilities and output of a unit's
heads (under the layer's mask, if any); :class:`ExactCache` keeps them for the last
(layer, image, heads) with the conversions the run needs (the probabilities in the run's dtype
on its device, their squared row norms, the output on the device, the attention sink's mass).
The plan runs the units of one (layer, image) consecutively (17 units per image-layer in W1),
so one entry is enough and at most one image-layer's arrays are held.

Long contexts: the truth by tiles
---------------------------------
Where a head's K x M probabilities exceed :data:`TILED_ABOVE` entries (K measured queries, M keys), under any
mask, the cache holds no probabilities at all: the output and each query's log-normaliser
:math:`\log Z_n` come from :func:`~randattn.estimators.softmax.tiled.tiled_attention` (the float64 flash
recurrence, memory O(K Dv) per head), and whatever needs a probability forms it again from
:math:`p_{nm} = e^{s_{nm} - \log Z_n}` one block at a time (the sink mass from key 0's column, the probability
error by key tiles: :mod:`~randattn.analysis.estimate_block`). The choice depends on the unit's size only, never
on the memory budget, so a run's rows do not depend on its budget. The recurrence sums in another order than the
dense softmax: the two agree to about 1e-15 relative per entry (tested at 1e-10 relative on every column).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from randattn._tensors import input_tensor
from randattn.analysis.plan import Unit
from randattn.estimators.masks import Mask

__all__ = ["TILED_ABOVE", "ExactCache", "exact_attention", "exact_log_normaliser", "exact_under_mask",
           "sink_mass_from_log_normaliser", "tiles_exact"]

#: a head's truth is taken by tiles where its K x M probabilities have more entries than this (1024 x 1024, 8 MiB of
#: float64 per head): the dense softmax, the float32 copy and the probability pass each hold that much per head and
#: replicate, which stops a run near a few thousand tokens; below it the dense path is as fast and keeps the bits of
#: every earlier table (the golden tables, the DINOv2 sweeps at 197 to 785 tokens)
TILED_ABOVE = 2**20

def tiles_exact(kind: Mask | str | None, queries: int, keys: int) -> bool:
    """Whether a unit with ``queries`` measured rows and ``keys`` keys under mask ``kind`` takes its truth by tiles
    (:data:`TILED_ABOVE`; the budget plays no part, so the rows do not depend on it). The tiled recurrence computes
    every mask, a sliding window's at a cost of its window, not of M."""
    Mask.parse(kind)  # a kind that names no mask is refused here too
    return queries * keys > TILED_ABOVE


def sink_mass_from_log_normaliser(q, k, log_normaliser, scale: float, *, torch: Any,
                                  kind: Mask | str | None = None) -> np.ndarray:
    r"""float64 ``(C,)``: :math:`\frac1K \sum_n p_{n0}`, :math:`p_{n0} = e^{s\, q_n \cdot k_0 - \log Z_n}`.

    Key 0 is visible to every query without a mask and under the causal one; under a sliding window of W keys
    (``kind``) only to the queries at tokens :math:`n + M - K < W` (the K queries are the last of the M tokens), and
    :math:`p_{n0} = 0` for the others.
    """
    tq = input_tensor(np.ascontiguousarray(q, dtype=np.float64), device=log_normaliser.device)
    tk0 = input_tensor(np.ascontiguousarray(k[..., :1, :], dtype=np.float64), device=log_normaliser.device)
    logits = (scale * tq @ tk0.transpose(-1, -2))[..., 0]
    window = Mask.parse(kind).window
    if window is not None:
        queries, keys = q.shape[-2], k.shape[-2]
        tokens = torch.arange(queries, device=logits.device) + (keys - queries)
        logits = logits.masked_fill(tokens >= window, -torch.inf)
    return (logits - log_normaliser).exp().mean(-1).cpu().numpy()


def exact_log_normaliser(kind: Mask | str | None, q, k, scale: float) -> np.ndarray:
    r"""float64 ``(C, N)``: :math:`\log Z_n = \log \sum_{m \in V_n} e^{s\, q_n \cdot k_m}`, by torch in float64
    (a logsumexp: finite for logits of any size), :math:`V_n` the keys visible under ``kind`` as in
    :func:`exact_under_mask`. What a promise on the denominator is measured against (dense truths; a tiled one
    has its own from the flash recurrence)."""
    import torch

    mask = Mask.parse(kind)
    tq, tk = (input_tensor(np.ascontiguousarray(a, dtype=np.float64)) for a in (q, k))
    logits = scale * (tq @ tk.transpose(-1, -2))
    if mask.masked:
        logits = logits.masked_fill_(~torch.from_numpy(mask.visible(q.shape[-2], k.shape[-2])), float("-inf"))
    return torch.logsumexp(logits, dim=-1).numpy()


def exact_under_mask(kind: Mask | str, q, k, v, scale: float, *, torch: Any = None) -> tuple[np.ndarray, np.ndarray]:
    r"""The sweep's ground truth under a mask: exact float64 softmax probabilities ``(C, N, M)``, output ``(C, N, Dv)``.

    .. math:: P_{nm} = \frac{\exp(s\, q_n \cdot k_m - c_n)}{\sum_{m' \in V_n} \exp(s\, q_n \cdot k_{m'} - c_n)}
        \ (m \in V_n), \qquad P_{nm} = 0 \ (m \notin V_n), \qquad y_n = \sum_m P_{nm} v_m,

    with :math:`V_n` the keys visible to query n under ``kind``
    (:meth:`~randattn.estimators.masks.Mask.visible`) and :math:`c_n` its largest visible logit (every row
    keeps its own key, so it is finite): the hidden logits are set to :math:`-\infty`, so the hidden
    probabilities are exactly 0. ``torch``: the torch module, to compute as the torch backend does
    (float64, the process's thread count); None: numpy.

    Parameters
    ----------
    kind : Mask or str
        A mask that hides some keys: ``"causal"`` or ``"sliding:W"``.
    q : (C, N, D) ndarray
    k : (C, M, D) ndarray
    v : (C, M, Dv) ndarray
    scale : float
        The logit temperature s.
    torch : module, optional
    """
    visible = Mask.parse(kind).visible(q.shape[-2], k.shape[-2])
    if torch is None:
        logits = np.where(visible, scale * (q @ np.swapaxes(k, -1, -2)), -np.inf)
        weights = np.exp(logits - logits.max(-1, keepdims=True))
        probs = weights / weights.sum(-1, keepdims=True)
        return probs, probs @ v
    tq, tk, tv = (input_tensor(np.ascontiguousarray(a, dtype=np.float64)) for a in (q, k, v))
    logits = (scale * (tq @ tk.transpose(-1, -2))).masked_fill_(~torch.from_numpy(visible), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return probs.numpy(), (probs @ tv).numpy()


def exact_attention(q, k, v, scale: float, kind: Mask | str | None, *,
                    torch: Any = None) -> tuple[np.ndarray, np.ndarray]:
    r"""Exact float64 softmax probabilities ``(C, N, M)`` and output ``(C, N, Dv)``.

    On the torch backend (``torch``: the torch module) they are computed by torch in float64 with
    the sweep's pinned thread count, so that every process (a Dask worker too) gets the same bits;
    numpy's BLAS takes its thread count from the environment, which a Dask nanny sets on its own.

    Under a mask (``kind``) the softmax runs over the visible keys only
    (:func:`exact_under_mask`): the hidden logits are set to :math:`-\infty`, so the hidden
    probabilities are exactly 0.

    Parameters
    ----------
    q : (C, N, D) ndarray
    k : (C, M, D) ndarray
    v : (C, M, Dv) ndarray
        float64 on the reference backend; any floating dtype on the torch backend (computed in float64).
    scale : float
        The logit temperature s.
    kind : Mask, str or None
        The layer's mask (:meth:`~randattn.analysis.plan.SweepConfig.layer_mask`) or its kind.
    torch : module, optional
        The torch module on the torch backend; None: numpy (the reference backend).
    """
    mask = Mask.parse(kind)
    if mask.masked:
        return exact_under_mask(mask, q, k, v, scale, torch=torch)
    if torch is None:
        from randattn.estimators.softmax.reference import attention_probabilities

        probs = attention_probabilities(q, k, scale=scale)
        return probs, probs @ v
    tq, tk, tv = (input_tensor(np.ascontiguousarray(a, dtype=np.float64)) for a in (q, k, v))
    probs = torch.softmax(scale * (tq @ tk.transpose(-1, -2)), dim=-1)
    return probs.numpy(), (probs @ tv).numpy()


class ExactCache:
    """The inputs and exact attention of the last (layer, image, heads), with their conversions per run.

    Parameters
    ----------
    acts : Activations
    layer_mask : callable
        ``layer -> Mask`` (:meth:`~randattn.analysis.plan.SweepConfig.layer_mask`).
    scale : float
        The logit temperature.
    probabilities : bool
        Whether the run measures the probabilities' error (only then are they converted for it).
    torch : module, optional
        The torch module on the torch backend; None: the reference backend (numpy).
    device : torch.device, optional
        Where the torch backend computes.
    rows : (K,) int array, optional
        The measured query rows (:mod:`randattn.analysis.queries`), increasing; None: every row. The inputs hold
        those K queries and every key, so the exact attention and everything derived from it are K rows: O(K M)
        per head, never N x M.
    """

    def __init__(self, acts, layer_mask: Callable[[int], Mask], scale: float, probabilities: bool, *,
                 torch: Any = None, device: Any = None, rows: Any = None) -> None:
        self.acts = acts
        self.rows = None if rows is None else np.asarray(rows, dtype=np.intp)
        self.layer_mask = layer_mask
        self.scale = scale
        self.probabilities = probabilities
        self.torch = torch
        self.device = device
        # (key, (q, k, v, exact_probs, exact), conversions): one image-layer's arrays at most (exact_probs None where
        # the truth is tiled; its log-normaliser is then conversions["log_normaliser"])
        self._last: tuple[tuple, tuple, dict] | None = None

    def tiled(self, unit: Unit, queries: int | None = None, keys: int | None = None) -> bool:
        """Whether ``unit``'s truth is taken by tiles (:func:`tiles_exact`); ``queries, keys`` default to the
        activations' measured rows and tokens."""
        if queries is None:
            queries = self.acts.shape[2] if self.rows is None else len(self.rows)
        if keys is None:
            keys = self.acts.shape[2]
        return tiles_exact(self.layer_mask(unit.layer), queries, keys)

    def tiled_exact(self, unit: Unit, q, k, v) -> tuple[np.ndarray, Any]:
        """The exact float64 output ``(C, K, Dv)`` (numpy) and log-normaliser ``(C, K)`` (a float64 tensor on the
        device) of ``q, k, v`` by :func:`~randattn.estimators.softmax.tiled.tiled_attention`."""
        import torch

        from randattn.estimators.softmax.tiled import tiled_attention

        device = self.device if self.torch is not None else None
        # in the inputs' dtype: the recurrence converts each tile to float64 as it reads it
        tq, tk, tv = (input_tensor(np.ascontiguousarray(a), device=device) for a in (q, k, v))
        out, log_normaliser = tiled_attention(tq, tk, tv, scale=self.scale, mask=self.layer_mask(unit.layer).kind)
        return out.cpu().numpy(), log_normaliser

    def inputs(self, unit: Unit) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``q : (C, K, D)`` (the measured query rows), ``k, v : (C, M, D)`` of the unit's heads: float64 on the
        reference backend, in the file's dtype on the torch backend.

        Taken through :meth:`~randattn.activations.io.Activations.layer_qkv` so that a grouped-query file's shared
        keys and values are gathered for the unit's heads of one image only, never expanded to the whole layer.
        The torch backend converts each block to the dtype it computes in (a float32 value converts to float64
        exactly, so the bits are those of a float64 copy), and the tiled truth converts one tile at a time: a
        float64 copy of a long context's keys and values would be twice the file's memory again.
        """
        q, k, v = self.acts.layer_qkv(unit.layer, heads=list(unit.heads), image=unit.image)
        if self.rows is not None:
            q = np.take(q, self.rows, axis=-2)
        if self.torch is None:
            return q.astype(np.float64), k.astype(np.float64), v.astype(np.float64)
        return q, k, v

    def exact(self, unit: Unit, q, k, v) -> tuple[np.ndarray, np.ndarray]:
        """:func:`exact_attention` of ``q, k, v`` under ``unit``'s mask, as this backend computes it."""
        return exact_attention(q, k, v, self.scale, self.layer_mask(unit.layer), torch=self.torch)

    def _entry(self, unit: Unit) -> tuple[tuple, dict]:
        """``((q, k, v, exact_probs, exact), conversions)`` of ``unit``'s heads, computed on a new image-layer."""
        key = (unit.layer, unit.image, tuple(unit.heads))
        if self._last is None or self._last[0] != key:
            q, k, v = self.inputs(unit)
            self._last = None  # the previous image-layer's arrays go before the next are made
            if self.tiled(unit):
                out, log_normaliser = self.tiled_exact(unit, q, k, v)
                self._last = (key, (q, k, v, None, out), {"log_normaliser": log_normaliser})
            else:
                self._last = (key, (q, k, v, *self.exact(unit, q, k, v)), {})
        return self._last[1], self._last[2]

    def _derived(self, unit: Unit) -> tuple[tuple, dict]:
        """:meth:`_entry`, after :meth:`get` in float64 as the derived arrays have always been taken (the
        float64 probabilities then stay cached on the device for the unit's float64 fallbacks)."""
        self.get(unit, "float64")
        return self._entry(unit)

    def get(self, unit: Unit, dtype_name: str):
        """``(q, k, v, exact_probs, exact)`` of the unit's heads; probabilities as a run-dtype tensor on torch.

        Parameters
        ----------
        unit : Unit
        dtype_name : str
            ``"float32"`` or ``"float64"``: the dtype of the probabilities on the torch backend.
        """
        (q, k, v, exact_probs, exact), converted = self._entry(unit)
        if self.torch is not None and self.probabilities and exact_probs is not None:
            if dtype_name not in converted:
                converted[dtype_name] = self.torch.as_tensor(exact_probs, device=self.device,
                                                             dtype=getattr(self.torch, dtype_name))
            exact_probs = converted[dtype_name]
        return q, k, v, exact_probs, exact

    def sq_norms(self, unit: Unit):
        """The exact probabilities' squared row norms ``||P_n||^2 (C, N)``, float64 on the device (cached)."""
        arrays, converted = self._derived(unit)
        if "sq_norms" not in converted:
            probs = arrays[3]
            converted["sq_norms"] = self.torch.as_tensor(np.einsum("...m,...m->...", probs, probs), device=self.device)
        return converted["sq_norms"]

    def sink_mass(self, unit: Unit) -> np.ndarray:
        """float64 ``(C,)``: each cell's exact attention probability on key 0, averaged over the queries.

        A language model's first token draws much of every head's attention (the attention sink); the column
        says how much, so a reader can relate an estimator's error to it. Cached with the exact attention.
        """
        arrays, converted = self._derived(unit)
        if "sink" not in converted:
            if arrays[3] is None:  # tiled: key 0's column from the log-normaliser
                import torch

                converted["sink"] = sink_mass_from_log_normaliser(arrays[0], arrays[1], converted["log_normaliser"],
                                                                  self.scale, torch=torch,
                                                                  kind=self.layer_mask(unit.layer))
            else:
                converted["sink"] = np.asarray(arrays[3][..., 0], dtype=np.float64).mean(-1)
        return converted["sink"]

    def log_normaliser(self, unit: Unit):
        """The log-normaliser ``(C, K)`` of a tiled unit's heads, a float64 tensor on the device; None where the
        unit's truth is dense."""
        return self._entry(unit)[1].get("log_normaliser")

    def log_normalisers(self, unit: Unit) -> np.ndarray:
        r"""float64 ``(C, K)``: each measured query's exact log-normaliser :math:`\log Z_n` (cached): the tiled
        truth's own, else :func:`exact_log_normaliser` of the unit's inputs."""
        arrays, converted = self._entry(unit)
        if "log_z" not in converted:
            tiled = converted.get("log_normaliser")
            converted["log_z"] = (tiled.cpu().numpy() if tiled is not None else
                                  exact_log_normaliser(self.layer_mask(unit.layer), arrays[0], arrays[1], self.scale))
        return converted["log_z"]

    def output(self, unit: Unit):
        """The exact output ``(C, N, Dv)`` as a float64 tensor on the device (cached)."""
        arrays, converted = self._derived(unit)
        if "output" not in converted:
            converted["output"] = self.torch.as_tensor(arrays[4], device=self.device)
        return converted["output"]
