"""EVA in torch (batched form of ``eva.reference``).

Vectorized over replicates, batch dims, queries and chunks (chunks of a group are padded to
a common length, padded keys get a log-feature of ``-inf``); a Python loop runs over chunk
groups only (one per local block for the paper's partition, one for ``reference-code``).
With one sample per chunk the coefficients are query-independent and are combined by a
matrix product, so no ``N x C x Dv`` tensor is formed.
The exact part gathers each query's ``E^n`` (``O(N |E| (D + Dv))``), never an N x M matrix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from randattn.estimators._prepare import check_draw_array, prepare_batched, to_torch_draws
from randattn.estimators.base import Draws
from randattn.estimators.eva.partition import Partition, eva_partition, pad_index_lists
from randattn.estimators.eva.reference import check_eva_params, chunk_proposal_mean, log_proposal_ratio
from randattn.estimators.features.batched import positive_log_features
from randattn.estimators.ra.reference import noise_std
from randattn.estimators.snis.batched import feature_attention

__all__ = ["estimate", "exact_logits", "combine", "chunk_terms", "GroupTerms"]


def _index(array: Any, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(array, device=device)


def exact_logits(x: torch.Tensor, y: torch.Tensor, layout: Partition) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits, index)``: ``x_n·y_m`` for ``m in E^n`` as ``(..., N, E_max)`` (``-inf`` padding) and ``(N, E_max)`` key indices."""
    idx, mask = pad_index_lists(layout.exact_keys)
    idx_t, mask_t = _index(idx, x.device), _index(mask, x.device)
    y_e = y[..., idx_t, :]  # (..., N, E_max, D)
    logits = (x.unsqueeze(-2) @ y_e.transpose(-1, -2)).squeeze(-2)
    return logits.masked_fill(~mask_t, float("-inf")), idx_t


@dataclass(frozen=True)
class GroupTerms:
    """One chunk group's terms: its queries, chunk log-weights and control coefficients.

    ``beta`` is ``(R, ..., C_g, Dv)`` when one sample per chunk makes it query-independent
    (app. C; then no ``N x C x Dv`` tensor is ever formed), else ``(R, ..., n_g, C_g, Dv)``.
    """

    queries: torch.Tensor  # (n_g,) query indices
    logw: torch.Tensor  # (R, ..., n_g, C_g)
    beta: torch.Tensor
    shared: bool


def combine(e_logits: torch.Tensor, v_exact: torch.Tensor, groups: list[GroupTerms]) -> torch.Tensor:
    r"""Eq. 16 in log space: one normalization over the union of exact logits and chunk log-weights.

    e_logits : (..., N, E), v_exact : (..., N, E, Dv), groups from :func:`chunk_terms` -> (R, ..., N, Dv).
    Every term is taken relative to the per-query maximum over both sets, which cancels in the ratio.
    """
    reps = groups[0].logw.shape[0] if groups else 1
    e_logits = e_logits.unsqueeze(0).expand(reps, *e_logits.shape)
    # per-query maximum over both sets (the exact set may be empty: window = 0)
    top = e_logits.amax(-1) if e_logits.shape[-1] else e_logits.new_full(e_logits.shape[:-1], float("-inf"))
    top = top.clone()  # (R, ..., N); groups hold disjoint queries
    for g in groups:
        if g.logw.shape[-1]:
            top[..., g.queries] = torch.maximum(top[..., g.queries], g.logw.amax(-1))
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w_exact = torch.exp(e_logits - top.unsqueeze(-1))
    # replicates as matrix rows: (..., N, R, E) @ (..., N, E, Dv); broadcasting v_exact over a
    # leading R would copy the local values once per replicate
    num = (w_exact.movedim(0, -2) @ v_exact).movedim(-2, 0)  # (R, ..., N, Dv)
    den = w_exact.sum(-1)  # (R, ..., N)
    for g in groups:
        if not g.logw.shape[-1]:
            continue
        w = torch.exp(g.logw - top[..., g.queries].unsqueeze(-1))  # (R, ..., n_g, C_g)
        part = w @ g.beta if g.shared else (w.unsqueeze(-1) * g.beta).sum(-2)
        num = num.index_add(-2, g.queries, part)
        den = den.index_add(-1, g.queries, w.sum(-1))
    return num / den.unsqueeze(-1)


def chunk_terms(
    x: torch.Tensor,
    y: torch.Tensor,
    v: torch.Tensor,
    eps: torch.Tensor | None,
    layout: Partition,
    *,
    replicates: int,
    sigma: float,
    chunk_weight: str,
    add_log_chunk_size: bool,
    proposal_mean: str,
) -> list[GroupTerms]:
    r"""Per chunk group: chunk log-weights ``(R, ..., n_g, C_g)`` and coefficients (see :class:`GroupTerms`).

    ``eps : (R, ..., C, S_c, D)`` or None for the expected sample :math:`\omega_c = \mu_c`.
    See ``eva.reference.estimate`` for the equations.
    """
    dim = x.shape[-1]
    batch = x.shape[:-2]
    ninf = float("-inf")
    groups = []
    for group in layout.groups:
        qi = _index(group.queries, x.device)
        x_g = x[..., qi, :]  # (..., n_g, D)
        n_g, c_g = len(group.queries), len(group.chunks)
        if c_g == 0:
            groups.append(GroupTerms(qi, x.new_zeros((replicates, *batch, n_g, 0)), x.new_zeros((replicates, *batch, 0, v.shape[-1])), True))
            continue
        kidx, kmask = pad_index_lists(group.chunks)
        sidx, smask = pad_index_lists(group.chunk_queries)
        kidx, kmask, sidx, smask = (_index(a, x.device) for a in (kidx, kmask, sidx, smask))
        y_c, v_c = y[..., kidx, :], v[..., kidx, :]  # (..., C_g, L, D / Dv)
        kfloat, sfloat = kmask.to(x.dtype), smask.to(x.dtype)
        sizes = kfloat.sum(-1)  # (C_g,)
        k_land = (y_c * kfloat.unsqueeze(-1)).sum(-2) / sizes.unsqueeze(-1)  # (..., C_g, D)
        q_land = (x[..., sidx, :] * sfloat.unsqueeze(-1)).sum(-2) / sfloat.sum(-1).unsqueeze(-1)
        mu = chunk_proposal_mean(proposal_mean, q_land, k_land).unsqueeze(0).unsqueeze(-2)  # (1, ..., C_g, 1, D)
        if eps is not None:
            omega = mu + sigma * eps[..., :c_g, :, :]  # (R, ..., C_g, S_c, D)
        else:
            omega = mu.expand(replicates, *batch, c_g, 1, dim)
        log_alpha = log_proposal_ratio(omega, mu, sigma)  # (R, ..., C_g, S_c)
        log_kf = positive_log_features(y_c.unsqueeze(0), omega)[0]  # (R, ..., C_g, L, S_c, 1)
        log_kf = log_kf.masked_fill(~kmask.unsqueeze(-1).unsqueeze(-1), ninf)
        shared = omega.shape[-2] == 1
        log_qf = None
        if shared:
            # one sample: the query feature and alpha cancel in the SNIS ratio (app. C), so
            # beta_c = softmax over the chunk's keys of log xi(y_m, omega_c), averaged values
            beta = (torch.softmax(log_kf[..., 0, 0], dim=-1).unsqueeze(-2) @ v_c.unsqueeze(0)).squeeze(-2)  # (R, ..., C_g, Dv)
        else:
            log_qf = positive_log_features(x_g.unsqueeze(-3).unsqueeze(0), omega)[0]  # (R, ..., C_g, n_g, S_c, 1)
            log_qf = log_qf + log_alpha.unsqueeze(-2).unsqueeze(-1)
            beta, _ = feature_attention(log_qf, log_kf, v_c.unsqueeze(0))  # (R, ..., C_g, n_g, Dv)
            beta = beta.movedim(-3, -2)  # (R, ..., n_g, C_g, Dv)
        if chunk_weight == "exact":
            scores = (x_g.unsqueeze(-3) @ y_c.transpose(-1, -2)).masked_fill(~kmask.unsqueeze(-2), ninf)
            logw = torch.logsumexp(scores, dim=-1).transpose(-1, -2).unsqueeze(0)  # (1, ..., n_g, C_g)
        elif chunk_weight == "mean-key":
            logw = (x_g @ k_land.transpose(-1, -2)).unsqueeze(0)
            if add_log_chunk_size:
                logw = logw + torch.log(sizes)
        else:
            if log_qf is None:
                log_qf = positive_log_features(x_g.unsqueeze(-3).unsqueeze(0), omega)[0]
                log_qf = log_qf + log_alpha.unsqueeze(-2).unsqueeze(-1)
            log_mass = torch.logsumexp(log_kf[..., 0], dim=-2)  # (R, ..., C_g, S_c)
            logw = torch.logsumexp(log_qf[..., 0] + log_mass.unsqueeze(-2), dim=-1) - math.log(omega.shape[-2])
            logw = logw.transpose(-1, -2)  # (R, ..., n_g, C_g)
        groups.append(GroupTerms(qi, logw.expand(replicates, *batch, n_g, c_g), beta, shared))
    return groups


def estimate(
    q: Any,
    k: Any,
    v: Any,
    draws: Draws,
    *,
    scale: float | None = None,
    window: int = 49,
    prefix_tokens: int = 0,
    partition: str = "paper",
    chunk_weight: str = "exact",
    add_log_chunk_size: bool = False,
    proposal_mean: str = "sum",
    sample: str = "random",
    noise: str = "paper",
    samples_per_chunk: int = 1,
) -> torch.Tensor:
    """EVA over (R, ..., N, Dv); same signature, equations and layout as ``eva.reference.estimate``."""
    check_eva_params(
        window=window, prefix_tokens=prefix_tokens, partition=partition, chunk_weight=chunk_weight,
        add_log_chunk_size=add_log_chunk_size, proposal_mean=proposal_mean, sample=sample, noise=noise,
        samples_per_chunk=samples_per_chunk,
    )
    x, y, v, scale, batch = prepare_batched(q, k, v, scale)
    sigma = noise_std(noise, scale)
    dim = x.shape[-1]
    draws = to_torch_draws(draws, x)
    eps = check_draw_array(draws, "eps", batch, (None, samples_per_chunk if sample == "random" else 0, dim))
    num_chunks = eps.shape[-3]
    if num_chunks < 1:
        raise ValueError(f"draws['eps'] has C = {num_chunks} chunks; EVA needs num_samples = C >= 1")
    layout = eva_partition(
        x.shape[-2], y.shape[-2], window=window, prefix_tokens=prefix_tokens, num_chunks=num_chunks, partition=partition
    )
    e_logits, e_idx = exact_logits(x, y, layout)
    groups = chunk_terms(
        x, y, v, eps if sample == "random" else None, layout, replicates=draws.replicates, sigma=sigma,
        chunk_weight=chunk_weight, add_log_chunk_size=add_log_chunk_size, proposal_mean=proposal_mean,
    )
    return combine(e_logits, v[..., e_idx, :], groups)
