"""EVA in torch (batched form of ``eva.reference``).

Vectorized over replicates, batch dims, queries and chunks (chunks of a group are padded to
a common length, padded keys get a log-feature of ``-inf``); a Python loop runs over chunk
groups only (one per local block for the paper's partition, one for ``reference-code``).
The exact part gathers each query's ``E^n`` (``O(N |E| (D + Dv))``), never an N x M matrix.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from randattn.estimators._prepare import check_draw_array, prepare_batched, to_torch_draws
from randattn.estimators.base import Draws
from randattn.estimators.eva.partition import Partition, eva_partition, pad_index_lists
from randattn.estimators.eva.reference import check_eva_params, chunk_proposal_mean, log_proposal_ratio
from randattn.estimators.features.batched import positive_log_features
from randattn.estimators.ra.reference import noise_std
from randattn.estimators.snis.batched import feature_attention

__all__ = ["estimate", "exact_logits", "combine", "chunk_terms"]


def _index(array: Any, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(array, device=device)


def exact_logits(x: torch.Tensor, y: torch.Tensor, layout: Partition) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits, index)``: ``x_n·y_m`` for ``m in E^n`` as ``(..., N, E_max)`` (``-inf`` padding) and ``(N, E_max)`` key indices."""
    idx, mask = pad_index_lists(layout.exact_keys)
    idx_t, mask_t = _index(idx, x.device), _index(mask, x.device)
    y_e = y[..., idx_t, :]  # (..., N, E_max, D)
    logits = (x.unsqueeze(-2) @ y_e.transpose(-1, -2)).squeeze(-2)
    return logits.masked_fill(~mask_t, float("-inf")), idx_t


def combine(
    e_logits: torch.Tensor, v_exact: torch.Tensor, chunk_logw: torch.Tensor, chunk_beta: torch.Tensor
) -> torch.Tensor:
    r"""Eq. 16 in log space: softmax over the union of exact logits and chunk log-weights.

    e_logits : (..., N, E), v_exact : (..., N, E, Dv), chunk_logw : (R, ..., N, C),
    chunk_beta : (R, ..., N, C, Dv) -> (R, ..., N, Dv).
    """
    reps = chunk_logw.shape[0]
    e_logits = e_logits.unsqueeze(0).expand(reps, *e_logits.shape)
    p = torch.softmax(torch.cat([e_logits, chunk_logw], dim=-1), dim=-1)
    n_exact = e_logits.shape[-1]
    local = (p[..., :n_exact].unsqueeze(-2) @ v_exact.unsqueeze(0)).squeeze(-2)
    return local + (p[..., n_exact:].unsqueeze(-1) * chunk_beta).sum(-2)


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
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Chunk log-weights ``(R, ..., N, C_max)`` (``-inf`` = no chunk) and coefficients ``(R, ..., N, C_max, Dv)``.

    ``eps : (R, ..., C, S_c, D)`` or None for the expected sample :math:`\omega_c = \mu_c`.
    See ``eva.reference.estimate`` for the equations.
    """
    num_q, dim, dv = x.shape[-2], x.shape[-1], v.shape[-1]
    batch = x.shape[:-2]
    c_max = layout.max_chunks
    ninf = float("-inf")
    logw_parts, beta_parts, order = [], [], []
    for group in layout.groups:
        qi = _index(group.queries, x.device)
        x_g = x[..., qi, :]  # (..., n_g, D)
        n_g, c_g = len(group.queries), len(group.chunks)
        order.append(group.queries)
        if c_g == 0:
            logw_parts.append(x.new_full((replicates, *batch, n_g, c_max), ninf))
            beta_parts.append(x.new_zeros((replicates, *batch, n_g, c_max, dv)))
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
            log_mass = torch.logsumexp(log_kf[..., 0], dim=-2)  # (R, ..., C_g, S_c)
            logw = torch.logsumexp(log_qf[..., 0] + log_mass.unsqueeze(-2), dim=-1) - math.log(omega.shape[-2])
            logw = logw.transpose(-1, -2)  # (R, ..., n_g, C_g)
        logw = logw.expand(replicates, *batch, n_g, c_g)
        pad = c_max - c_g
        logw_parts.append(torch.nn.functional.pad(logw, (0, pad), value=ninf))
        beta_parts.append(torch.nn.functional.pad(beta, (0, 0, 0, pad), value=0.0))
    order_t = torch.as_tensor(np.concatenate(order), device=x.device)
    inverse = torch.empty_like(order_t)
    inverse[order_t] = torch.arange(num_q, device=x.device)
    logw_all = torch.cat(logw_parts, dim=-2).index_select(-2, inverse)
    beta_all = torch.cat(beta_parts, dim=-3).index_select(-3, inverse)
    return logw_all, beta_all


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
    logw, beta = chunk_terms(
        x, y, v, eps if sample == "random" else None, layout, replicates=draws.replicates, sigma=sigma,
        chunk_weight=chunk_weight, add_log_chunk_size=add_log_chunk_size, proposal_mean=proposal_mean,
    )
    return combine(e_logits, v[..., e_idx, :], logw, beta)
