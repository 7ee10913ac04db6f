r"""EVA in torch (batched form of ``eva.reference``).

Vectorized over replicates, batch dims, local blocks, chunks and samples: the partition
(:meth:`randattn.estimators.eva.partition.PaddedPartition.of`) is a set of padded index arrays,
padded keys get a log-weight of ``-inf``. No Python loop runs over blocks or chunks; the only
loop is over *slices* of blocks, so that the working set stays under :data:`WORK_ELEMENTS`
(one slice unless the per-group chunk terms of ``partition="paper"`` or the quadratic
``chunk_weight="exact"`` would exceed it).

Per chunk ``c`` and sample ``s`` the key side is reduced once to a log-mass
:math:`A_{cs} = \log\sum_{m \in P_c} \xi(y_m, \omega_{cs})` and a value mean
:math:`\bar v_{cs} = \sum_m \xi(y_m,\omega_{cs}) v_m / e^{A_{cs}}`; the SNIS coefficient of
query ``n`` is then :math:`\beta_{nc} = \sum_s w_{ncs} \bar v_{cs}` with
:math:`w_{ncs} \propto \alpha_{cs}\,\xi(x_n, \omega_{cs}) e^{A_{cs}}` (EVA app. C), and the
output :math:`\sum_c p_{nc} \beta_{nc}` is one matrix product of the weights
:math:`p_{nc} w_{ncs}` with :math:`\bar v`, so no ``N x C x Dv`` tensor is formed. With one
sample per chunk :math:`w = 1` and :math:`\beta_c` is query-independent.
The exact part multiplies each block's queries with its exact keys, ``O(N |E| (D + Dv))``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from randattn.estimators._prepare import prepare_batched, to_torch_draws
from randattn.estimators.base import Draws, keyword_entry
from randattn.estimators.eva.partition import PaddedPartition, eva_partition
from randattn.estimators.eva.reference import EvaOptions, chunk_noise, chunk_proposal_mean, log_proposal_ratio
from randattn.estimators.ra.reference import noise_std

__all__ = ["estimate", "probabilities", "estimate_with_probabilities", "eva_attention", "block_exact_attention", "WORK_ELEMENTS"]

#: elements of the largest intermediate tensors of one slice of blocks (2^23: 32 MiB in float32). Slices about the
#: size of a last-level cache were the fastest on the 2-core CPU measured (785 tokens, S = 16..128: 2^21 .. 2^25)
WORK_ELEMENTS = 2**23


def _t(array: Any, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(array, device=device)


def _gather(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t[..., index, :]`` for an integer ``index`` of any shape, rows copied whole.

    One ``index_select`` of whole rows of the 2-D ``(prod(...) * rows, width)`` view (on CPU
    several times faster than ``index_select`` on a middle dim or advanced indexing).
    """
    lead, rows, width = t.shape[:-2], t.shape[-2], t.shape[-1]
    count = math.prod(lead)
    flat_index = index.reshape(1, -1) + (torch.arange(count, device=t.device) * rows).unsqueeze(-1)
    out = t.reshape(count * rows, width).index_select(0, flat_index.reshape(-1))
    return out.reshape(*lead, *index.shape, width)


def _gather_last(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t[..., index]`` for an integer ``index`` of any shape."""
    return t.index_select(-1, index.reshape(-1)).reshape(*t.shape[:-1], *index.shape)


def _group_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a (..., n, Q, D) @ b (..., g, K, D)^T -> (..., n, Q, K)`` with ``g`` in {1, n}.

    ``g = 1`` (one chunk group shared by every block) is one flat product; broadcasting it
    over ``n`` in ``torch.matmul`` would copy ``b`` once per block.
    """
    if b.shape[-3] == 1 and a.shape[-3] != 1:
        flat = a.reshape(*a.shape[:-3], a.shape[-3] * a.shape[-2], a.shape[-1]) @ b[..., 0, :, :].transpose(-1, -2)
        return flat.reshape(*a.shape[:-1], b.shape[-2])
    return a @ b.transpose(-1, -2)


def _group_mix(p: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    """``p (..., n, Q, K) @ vals (..., g, K, Dv) -> (..., n, Q, Dv)`` with ``g`` in {1, n}."""
    if vals.shape[-3] == 1 and p.shape[-3] != 1:
        flat = p.reshape(*p.shape[:-3], p.shape[-3] * p.shape[-2], p.shape[-1]) @ vals[..., 0, :, :]
        return flat.reshape(*p.shape[:-1], vals.shape[-1])
    return p @ vals


def _rows_matmul(p: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    """``p (R, ..., Q, K) @ vals (..., K, Dv)`` with the replicates as matrix rows (no copy of ``vals`` per replicate)."""
    reps = p.shape[0]
    rows = p.movedim(0, -3).reshape(*p.shape[1:-2], reps * p.shape[-2], p.shape[-1])
    out = rows @ vals
    return out.reshape(*p.shape[1:-2], reps, p.shape[-2], vals.shape[-1]).movedim(-3, 0)


def _projections(a: torch.Tensor, w: torch.Tensor, grouped: bool) -> torch.Tensor:
    """``a (..., n, Q, D) . w (R, ..., g, K, D) -> (R, ..., n, Q, K)``, replicates as matrix columns.

    ``grouped``: ``g`` pairs with ``n`` (``g in {1, n}``, via :func:`_group_matmul`); else the
    two share all their dims. Putting ``R`` into the columns avoids copying ``a`` per replicate.
    """
    reps, k = w.shape[0], w.shape[-2]
    cols = w.movedim(0, -3).reshape(*w.shape[1:-2], reps * k, w.shape[-1])
    out = _group_matmul(a, cols) if grouped else a @ cols.transpose(-1, -2)
    return out.reshape(*out.shape[:-1], reps, k).movedim(-2, 0)


@dataclass(frozen=True)
class ChunkTerms:
    """Per chunk group (``G``), chunk (``C``) and sample (``S``): the key-side reductions.

    ``k_land (..., G, C, D)``, ``sizes (G, C)``, ``omega (R', ..., G, C, S, D)``,
    ``log_alpha (R', ..., G, C, S)``, ``log_mass (R', ..., G, C, S)`` (0 for empty chunks),
    ``v_mean (R', ..., G, C, S, Dv)``; ``R'`` is R, or 1 for the deterministic expected sample.
    Without values (the implied probabilities) ``v_mean`` is the key distribution itself,
    ``(R', ..., G, C, S, L)`` over each chunk's key slots (0 on padding). ``key_probs`` is that
    distribution when both are asked for (the estimate and its implied probabilities), else None.
    """

    k_land: torch.Tensor
    sizes: torch.Tensor
    omega: torch.Tensor
    log_alpha: torch.Tensor
    log_mass: torch.Tensor
    v_mean: torch.Tensor
    key_probs: torch.Tensor | None = None


@dataclass(frozen=True)
class _ChunkIndex:
    """The partition's chunk arrays on the device, uploaded once per call: each is (G, C, L), about G x M integers
    for the paper's partition, so uploading them for every slice of blocks would move them (G / slice) times."""

    keys: torch.Tensor
    key_mask: torch.Tensor
    sources: torch.Tensor
    source_mask: torch.Tensor

    @classmethod
    def of(cls, pad: PaddedPartition, device: torch.device) -> _ChunkIndex:
        return cls(_t(pad.chunk_keys, device), _t(pad.chunk_key_mask, device), _t(pad.chunk_sources, device),
                   _t(pad.chunk_source_mask, device))


def _chunk_terms(x, y, v, y_sq, eps, chunks: _ChunkIndex, groups: torch.Tensor, *, sigma: float, proposal_mean: str,
                 with_key_probs: bool = False) -> ChunkTerms:
    """Key-side terms of the chunk groups ``groups`` (EVA eq. 28 proposal, app. C SNIS)."""
    ck, ckm = chunks.keys[groups], chunks.key_mask[groups]  # (G, C, L)
    cs, csm = chunks.sources[groups], chunks.source_mask[groups]
    kf, sf = ckm.to(x.dtype), csm.to(x.dtype)
    sizes = kf.sum(-1)  # (G, C)
    y_c = _gather(y, ck)  # (..., G, C, L, D)
    # masked means as products (G, C, 1, L) @ (..., G, C, L, D): no masked copy of the keys
    k_land = (kf.unsqueeze(-2) @ y_c).squeeze(-2) / sizes.clamp(min=1).unsqueeze(-1)  # (..., G, C, D)
    q_land = (sf.unsqueeze(-2) @ _gather(x, cs)).squeeze(-2) / sf.sum(-1).clamp(min=1).unsqueeze(-1)
    mu = chunk_proposal_mean(proposal_mean, q_land, k_land).unsqueeze(0).unsqueeze(-2)  # (1, ..., G, C, 1, D)
    num_chunks = ck.shape[-2]
    if eps is not None:
        omega = mu + sigma * eps[..., :num_chunks, :, :].unsqueeze(-4)  # (R, ..., G, C, S, D)
    else:
        omega = mu
    log_alpha = log_proposal_ratio(omega, mu, sigma)  # (R', ..., G, C, S)
    # log xi(y_m, omega_cs) = omega_cs . y_m - |y_m|^2 / 2 (Performer eq. 7): (R', ..., G, C, L, S)
    log_kf = _projections(y_c, omega, grouped=False) - 0.5 * _gather_last(y_sq, ck).unsqueeze(0).unsqueeze(-1)
    # in place: log_kf is a new (R', ..., G, C, L, S) array, the largest of the causal form, used once
    log_kf = log_kf.masked_fill_(~ckm.unsqueeze(-1), float("-inf"))
    log_mass = torch.logsumexp(log_kf, dim=-2)  # (R', ..., G, C, S)
    log_mass = torch.where(sizes.unsqueeze(-1) > 0, log_mass, torch.zeros_like(log_mass))  # empty chunks: weight -inf later
    key_probs = log_kf.sub_(log_mass.unsqueeze(-2)).exp_()  # (R', ..., G, C, L, S)
    key_probs = key_probs.transpose(-1, -2)  # (R', ..., G, C, S, L)
    if v is None:  # v = I_M: the values' weights themselves, over the chunk's key slots
        return ChunkTerms(k_land, sizes, omega, log_alpha, log_mass, key_probs)
    v_mean = _rows_matmul(key_probs, _gather(v, ck))  # (R', ..., G, C, S, Dv)
    return ChunkTerms(k_land, sizes, omega, log_alpha, log_mass, v_mean, key_probs if with_key_probs else None)


def _with_chunks(rows: torch.Tensor, index: torch.Tensor, chunk_rows: torch.Tensor, shared: bool) -> torch.Tensor:
    """``[rows[..., index[b], :]; chunk_rows[..., g(b), :, :]]`` per block ``b``: ``(..., b, E + C, width)``.

    ``chunk_rows (..., g, C, width)`` holds one group (``shared``: the same C rows for every
    block, gathered from ``[rows; chunk rows]`` by one lookup; concatenating a broadcast view
    instead is a slow strided copy) or one group per block.
    """
    if shared:
        num_rows, num_c = rows.shape[-2], chunk_rows.shape[-2]
        source = torch.cat([rows, chunk_rows[..., 0, :, :]], dim=-2)  # (..., M + C, width)
        chunk_index = (num_rows + torch.arange(num_c, device=index.device)).expand(index.shape[0], num_c)
        return _gather(source, torch.cat([index, chunk_index], dim=-1))
    return torch.cat([_gather(rows, index), chunk_rows], dim=-2)


def _slice_size(pad: PaddedPartition, reps: int, batch_numel: int, samples: int, dv: int, dim: int, exact_weight: bool,
                per_group: bool, value_width: int) -> int:
    """Blocks per slice so that the largest per-slice tensors stay under :data:`WORK_ELEMENTS`.

    Per block: its logits and output rows ``R Q (E + C S + max(D, dv))`` (``dv = M`` for the
    implied probabilities), the exact chunk weights' scores ``Q C L``, and with one chunk group
    per block its key-side terms (:func:`_chunk_terms`): the gathered keys and values
    ``C L max(D, value_width)``, shared by the replicates, and the key log-features and
    distributions ``R C L S``.
    """
    num_blocks, q = pad.block_queries.shape
    e = pad.block_keys.shape[1]
    _, c, l = pad.chunk_keys.shape
    per_block = reps * batch_numel * q * (e + c * samples + max(dim, dv))
    if exact_weight:
        per_block += batch_numel * q * c * l
    if per_group:
        per_block += batch_numel * c * l * (reps * samples + max(dim, value_width))
    return max(1, min(num_blocks, WORK_ELEMENTS // max(per_block, 1)))


def eva_attention(
    x: torch.Tensor,
    y: torch.Tensor,
    v: torch.Tensor | None,
    eps: torch.Tensor | None,
    pad: PaddedPartition,
    *,
    replicates: int,
    sigma: float,
    chunk_weight: str,
    add_log_chunk_size: bool,
    proposal_mean: str,
    with_probabilities: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""EVA (eq. 16 with app. C coefficients) from prepared inputs and a padded partition -> (R, ..., N, Dv).

    ``x, y`` are the scaled queries/keys ``(..., N|M, D)``, ``eps : (R, ..., C, S, D)`` the
    standard normals (None for the expected sample :math:`\omega_c = \mu_c`). See
    ``eva.reference.estimate`` for the equations; this is the same arithmetic regrouped.

    ``v = None`` stands for ``I_M`` without forming it: the result is the implied attention
    probabilities ``(R, ..., N, M)``, each block's exact and chunk weights scattered to the key
    columns they weigh (``O(N M)``, where ``I_M`` would cost products with M columns).
    ``with_probabilities`` (with ``v``): the pair (output, implied probabilities) from the same
    weights, each the same bits as its own call.
    """
    dev, dim = x.device, x.shape[-1]
    with_probabilities = with_probabilities and v is not None
    # the slices are those of the probability pass whenever it runs, so that both results match their own calls
    dv = y.shape[-2] if v is None or with_probabilities else v.shape[-1]
    batch = x.shape[:-2]
    batch_numel = math.prod(batch)
    num_groups = pad.chunk_keys.shape[0]
    samples = 1 if eps is None else eps.shape[-2]
    shared_groups = num_groups == 1
    y_sq, x_sq = (y * y).sum(-1), (x * x).sum(-1)  # (..., M), (..., N)
    slice_blocks = _slice_size(pad, replicates, batch_numel, samples, dv, dim, chunk_weight == "exact", not shared_groups,
                               0 if v is None else v.shape[-1])
    all_terms = None
    chunks = _ChunkIndex.of(pad, dev)
    only_group = _t([0], dev)  # reference-code: every block's chunks are group 0's
    if shared_groups:
        all_terms = _chunk_terms(x, y, v, y_sq, eps, chunks, only_group, sigma=sigma, proposal_mean=proposal_mean,
                                 with_key_probs=with_probabilities)

    bq_all, bk_all = _t(pad.block_queries, dev), _t(pad.block_keys, dev)
    bkm_all, gob_all = _t(pad.block_key_mask, dev), _t(pad.group_of_block, dev)
    seen_all = None if pad.exact_visible is None else _t(pad.exact_visible, dev)  # (B, Q, E), causal only
    pieces = []
    wide = None  # the implied probabilities (R, ..., N, M), filled slice by slice in query order
    if v is None or with_probabilities:
        wide = x.new_empty((replicates, *batch, x.shape[-2], y.shape[-2]))
        slot_query = _query_of_slot(pad, dev)
        num_slots = bq_all.shape[1]
    for start in range(0, bq_all.shape[0], slice_blocks):
        sl = slice(start, start + slice_blocks)
        bq, bk, bkm = bq_all[sl], bk_all[sl], bkm_all[sl]
        if shared_groups:
            terms = all_terms
        else:
            terms = _chunk_terms(x, y, v, y_sq, eps, chunks, gob_all[sl], sigma=sigma, proposal_mean=proposal_mean,
                                 with_key_probs=with_probabilities)
        x_b = _gather(x, bq)  # (..., b, Q, D)
        num_e, num_b = bk.shape[-1], bk.shape[0]
        chunk_ok = terms.sizes > 0  # (g, C)

        def per_block(a: torch.Tensor, dim: int) -> torch.Tensor:  # group terms -> blocks (dim = the group axis)
            return a.expand(*a.shape[:dim], num_b, *a.shape[dim + 1:]) if shared_groups else a

        log_qf = None
        if chunk_weight == "rfa" or samples > 1:
            # log alpha_cs + log xi(x_n, omega_cs): (R', ..., b, Q, C, S)
            g_, c_ = terms.omega.shape[-4], terms.omega.shape[-3]
            omega_flat = terms.omega.reshape(*terms.omega.shape[:-4], g_, c_ * samples, dim)
            log_qf = _projections(x_b, omega_flat, grouped=True) - 0.5 * _gather_last(x_sq, bq).unsqueeze(-1)
            log_qf = log_qf.reshape(*log_qf.shape[:-1], c_, samples) + terms.log_alpha.unsqueeze(-3)
        if chunk_weight == "mean-key":
            # exact logits and eq. 16 weights x_n . k~_c from one product with [exact keys; chunk landmarks]
            keys = _with_chunks(y, bk, terms.k_land, shared_groups)  # (..., b, E + C, D)
            logits = (x_b @ keys.transpose(-1, -2)).unsqueeze(0)  # (1, ..., b, Q, E + C)
            if add_log_chunk_size:
                logits[..., num_e:] += torch.log(terms.sizes.clamp(min=1)).unsqueeze(-2)
        else:
            e_logits = x_b @ _gather(y, bk).transpose(-1, -2)  # (..., b, Q, E)
            if chunk_weight == "exact":
                groups = gob_all[sl] if not shared_groups else only_group
                ck = chunks.keys[groups]  # (g, C, L)
                y_c = _gather(y, ck.reshape(ck.shape[0], -1))  # (..., g, C*L, D)
                scores = _group_matmul(x_b, y_c).reshape(*x_b.shape[:-1], ck.shape[-2], ck.shape[-1])
                scores = scores.masked_fill(~chunks.key_mask[groups].unsqueeze(-3), float("-inf"))
                logw = torch.logsumexp(scores, dim=-1).unsqueeze(0)  # (1, ..., b, Q, C)
            else:  # rfa: log (1/S) sum_s alpha xi(x, w_s) sum_m xi(y_m, w_s)
                logw = torch.logsumexp(log_qf + terms.log_mass.unsqueeze(-3), dim=-1) - math.log(samples)
            logits = torch.cat([e_logits.unsqueeze(0).expand(logw.shape[0], *e_logits.shape), logw], dim=-1)
        # padding: missing exact keys and missing chunks get -inf
        if pad.exact_visible is None:
            valid = torch.cat([bkm, per_block(chunk_ok, 0)], dim=-1)  # (b, E + C)
            # unconditionally: asking whether any slot is padding would read the answer back from the device
            logits.masked_fill_(~valid.unsqueeze(-2), float("-inf"))
        else:  # causal: Algorithm 2's K x K triangle M^E per query; every chunk of a block lies wholly before it
            seen = seen_all[sl]  # (b, Q, E)
            chunks_seen = per_block(chunk_ok, 0).unsqueeze(-2).expand(num_b, seen.shape[-2], chunk_ok.shape[-1])
            logits.masked_fill_(~torch.cat([seen, chunks_seen], dim=-1), float("-inf"))

        # eq. 16: one softmax over the exact logits and the chunk log-weights of each query
        probs = torch.softmax(logits, dim=-1)  # (R|1, ..., b, Q, E + C)
        v_mean = terms.v_mean  # (R', ..., g, C, S, Dv)
        chunk_keys = chunks.keys[gob_all[sl] if not shared_groups else only_group]
        if wide is not None:
            key_probs = v_mean if v is None else terms.key_probs
            _place_rows(wide, _scatter_probabilities(probs, key_probs, log_qf, terms, bk, chunk_keys, num_e,
                                                     y.shape[-2], samples),
                        slot_query[start * num_slots:(start + num_b) * num_slots])
        if v is None:
            continue
        if samples == 1:
            # beta_c is query-independent: one product with [exact values; chunk coefficients]
            v_chunks = v_mean[..., 0, :]  # (R', ..., g, C, Dv)
            v_rows = v.unsqueeze(0).expand(v_chunks.shape[0], *v.shape)
            out = probs @ _with_chunks(v_rows, bk, v_chunks, shared_groups)  # (R, ..., b, Q, Dv)
        else:
            mix = torch.softmax(log_qf + terms.log_mass.unsqueeze(-3), dim=-1)  # w_ncs: (R, ..., b, Q, C, S)
            weights = (probs[..., num_e:].unsqueeze(-1) * mix).flatten(-2)  # (R, ..., b, Q, C*S)
            v_flat = v_mean.flatten(-3, -2)  # (R, ..., g, C*S, Dv)
            out = _rows_matmul(probs[..., :num_e], _gather(v, bk)) + _group_mix(weights, v_flat)
        pieces.append(out.expand(replicates, *out.shape[1:]))
    if v is None:
        return wide
    joined = torch.cat(pieces, dim=-3) if len(pieces) > 1 else pieces[0]  # (R, ..., B, Q, Dv)
    out = _gather(joined.flatten(-3, -2), _t(pad.query_slot, dev))  # slots -> query order
    return (out, wide) if with_probabilities else out


def _query_of_slot(pad: PaddedPartition, device: torch.device) -> np.ndarray:
    """The query in each slot (block, position) of the partition, ``(B * Q,)``; -1 on padding slots.

    A host array: which slots are padding is known before any device work, so nothing is read back.
    """
    slot_query = np.full(pad.block_queries.size, -1, dtype=np.int64)
    slot_query[np.asarray(pad.query_slot)] = np.arange(len(pad.query_slot))
    return slot_query


def _place_rows(dest: torch.Tensor, piece: torch.Tensor, slot_query: torch.Tensor) -> None:
    """Copies the rows of ``piece (R|1, ..., b, Q, W)`` to the queries ``slot_query (b * Q,)`` of ``dest (R, ..., N, W)``.

    Each slice's rows go straight to their queries' rows: no join of the slices and no gather of
    the whole ``(R, ..., N, M)`` result afterwards (two copies of it). Padding slots (-1) are skipped.
    """
    num_q, width = dest.shape[-2], dest.shape[-1]
    lead = math.prod(dest.shape[:-2])
    rows = piece.expand(dest.shape[0], *piece.shape[1:]).flatten(-3, -2)  # (R, ..., b Q, W)
    valid = np.flatnonzero(slot_query >= 0)  # host arrays: no read back from the device
    if valid.size != slot_query.size:
        rows = rows.index_select(-2, torch.as_tensor(valid, device=dest.device))
        slot_query = slot_query[valid]
    queries = torch.as_tensor(slot_query, device=dest.device)
    dest_rows = (torch.arange(lead, device=dest.device) * num_q).unsqueeze(-1) + queries  # (R ..., b Q)
    dest.view(lead * num_q, width).index_copy_(0, dest_rows.reshape(-1), rows.reshape(-1, width))


def _scatter_probabilities(probs, key_probs, log_qf, terms: ChunkTerms, bk, ck, num_e: int, num_keys: int,
                           samples: int) -> torch.Tensor:
    """Implied probabilities of a slice of blocks ``(R, ..., b, Q, M)`` from its softmax weights (eq. 16).

    ``probs (R|1, ..., b, Q, E + C)`` weigh the exact keys ``bk (b, E)`` and the chunks; chunk
    ``c`` spreads its weight over its keys ``ck (g, C, L)`` by ``key_probs (R', ..., g, C, S, L)``
    (mixed over the S samples by ``w_ncs`` when S > 1). Exact keys and chunk keys of a block are
    disjoint, and padded slots carry weight 0, so one scatter-add per part places every weight.
    """
    num_b, num_q = probs.shape[-3], probs.shape[-2]
    lead = probs.shape[:-3]
    chunk_w = probs[..., num_e:]  # (R|1, ..., b, Q, C)
    if samples == 1:
        # (R, ..., b, Q, C, 1) * (R', ..., g, 1, C, L): chunk weight times its key distribution
        spread = chunk_w.unsqueeze(-1) * key_probs[..., 0, :].unsqueeze(-3)
    else:
        mix = torch.softmax(log_qf + terms.log_mass.unsqueeze(-3), dim=-1)  # w_ncs: (R, ..., b, Q, C, S)
        weights = (chunk_w.unsqueeze(-1) * mix).movedim(-2, -3)  # (R, ..., b, C, Q, S)
        spread = (weights @ key_probs).movedim(-3, -2)  # groups g in {1, b} broadcast: (R, ..., b, Q, C, L)
    spread = spread.flatten(-2)  # (R, ..., b, Q, C * L)
    reps = max(probs.shape[0], spread.shape[0])
    out = probs.new_zeros((reps, *lead[1:], num_b, num_q, num_keys))
    exact_cols = bk.unsqueeze(-2).expand(num_b, num_q, bk.shape[-1])  # (b, Q, E)
    out.scatter_add_(-1, exact_cols.expand(*out.shape[:-1], num_e), probs[..., :num_e].expand(*out.shape[:-1], num_e))
    chunk_cols = ck.reshape(ck.shape[0], 1, -1).expand(num_b, num_q, ck.shape[-2] * ck.shape[-1])  # (b, Q, C L)
    out.scatter_add_(-1, chunk_cols.expand(*out.shape[:-1], chunk_cols.shape[-1]), spread.expand(*out.shape[:-1], spread.shape[-1]))
    return out


def block_exact_attention(x: torch.Tensor, y: torch.Tensor, v: torch.Tensor, pad: PaddedPartition) -> torch.Tensor:
    """Softmax over each query's exact set ``E^n`` alone (local attention) -> (..., N, Dv).

    Under a causal partition (``pad.exact_visible``) each query sees its block's keys up to its own token.
    """
    dev = x.device
    bq, bk, bkm = _t(pad.block_queries, dev), _t(pad.block_keys, dev), _t(pad.block_key_mask, dev)
    seen = bkm.unsqueeze(-2) if pad.exact_visible is None else _t(pad.exact_visible, dev)  # (B, 1|Q, E)
    logits = (_gather(x, bq) @ _gather(y, bk).transpose(-1, -2)).masked_fill(~seen, float("-inf"))
    out = torch.softmax(logits, dim=-1) @ _gather(v, bk)  # (..., B, Q, Dv)
    return _gather(out.flatten(-3, -2), _t(pad.query_slot, dev))


@keyword_entry(EvaOptions)
def estimate(q: Any, k: Any, v: Any, draws: Draws, options: EvaOptions) -> torch.Tensor:
    """EVA over (R, ..., N, Dv); same signature, equations and layout as ``eva.reference.estimate`` (``mask`` included)."""
    return _evaluate(q, k, v, draws, options)


def _evaluate(q: Any, k: Any, v: Any | None, draws: Draws, options: EvaOptions, with_probabilities: bool = False):
    """:func:`estimate`, or the implied probabilities when ``v`` is None (``I_M``, never formed), or both."""
    identity = v is None
    x, y, v, scale, batch = prepare_batched(q, k, k if identity else v, options.scale)
    v = None if identity else v
    sigma = noise_std(options.noise, scale)
    draws = to_torch_draws(draws, x)
    eps, num_chunks = chunk_noise(draws, batch, x.shape[-1], options)
    pad = PaddedPartition.of(eva_partition(
        x.shape[-2], y.shape[-2], window=options.window, prefix_tokens=options.prefix_tokens, num_chunks=num_chunks,
        partition=options.partition, grid=options.resolved_grid, mask=options.mask,
    ))
    return eva_attention(
        x, y, v, eps if options.sample == "random" else None, pad, replicates=draws.replicates, sigma=sigma,
        chunk_weight=options.chunk_weight, add_log_chunk_size=options.add_log_chunk_size,
        proposal_mean=options.proposal_mean, with_probabilities=with_probabilities,
    )


@keyword_entry(EvaOptions)
def probabilities(q: Any, k: Any, draws: Draws, options: EvaOptions) -> torch.Tensor:
    """The attention probabilities EVA implies, ``(R, ..., N, M)``: :func:`estimate` with ``v = I_M``.

    Same parameters as :func:`estimate`; the exact and chunk weights are scattered to their key
    columns (``O(N M)``) instead of multiplying an identity. Under ``mask="causal"`` the hidden
    entries (``m > n + M - N``) are exact zeros: no chunk holds a hidden key, and the hidden keys of
    the block have weight ``exp(-inf) = 0``.
    """
    return _evaluate(q, k, None, draws, options)


@keyword_entry(EvaOptions)
def estimate_with_probabilities(q: Any, k: Any, v: Any, draws: Draws,
                                options: EvaOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """``(estimate(q, k, v, ...), probabilities(q, k, ...))``, the same bits: the chunk terms and weights computed once.

    Same parameters as :func:`estimate`.
    """
    return _evaluate(q, k, v, draws, options, with_probabilities=True)
