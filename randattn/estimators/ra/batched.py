"""Randomized attention in torch (batched form of ``ra.reference``), chunked over samples; bidirectional or causal."""

from __future__ import annotations

from typing import Any

import torch

from randattn.estimators._prepare import check_draw_array, prepare_batched, to_torch_draws
from randattn.estimators.base import Draws, keyword_entry
from randattn.estimators.masks import Mask
from randattn.estimators.ra.reference import RaOptions, noise_std

__all__ = ["estimate", "probabilities", "estimate_with_probabilities"]

#: cap on the elements of the (N, S_chunk, M) logits block of one replicate and batch element; the chunk
#: depends on N and M only, so that a result does not change with how many replicates or heads run together
_MAX_BLOCK = 1 << 21


def _sum_samples(t: torch.Tensor, reps: int, batch: tuple, num_q: int, s: int) -> torch.Tensor:
    """``(R, ..., N s, W) -> (R, ..., N, W)``, summed over the s samples of each query; a view when s = 1.

    (A sum over one sample would copy the whole array, an (N, M) pass per replicate for the probabilities.)
    """
    if s == 1:
        return t.reshape(reps, *batch, num_q, t.shape[-1])
    return t.reshape(reps, *batch, num_q, s, t.shape[-1]).sum(-2)


def _f_mean(omega: torch.Tensor, y: torch.Tensor, v: torch.Tensor | None, with_probabilities: bool = False,
            hidden: torch.Tensor | None = None):
    """Sum over samples of f_n(omega) (eq. 6) for omega (R, ..., N, S, D), chunked over S.

    ``hidden`` (N, M) boolean, True where the causal mask hides key m from query n: those logits
    become -inf, so eq. 6's softmax runs over the visible keys and gives exact zeros elsewhere.

    ``v = None`` stands for ``I_M`` without forming it: the sum of the softmaxes themselves, ``(R, ..., N, M)``.
    ``with_probabilities``: the pair (sum for ``v``, sum for ``I_M``) from the same softmaxes.

    Queries and samples are folded into one matrix dimension so that each product is
    ``(R, ..., N s, D) @ (..., D, M)``: a broadcasting matmul against ``(1, ..., 1, D, M)``
    would materialize the keys (and values) once per query, ``R N D M`` elements.
    """
    reps, num_q, num_s, dim = omega.shape[0], omega.shape[-3], omega.shape[-2], omega.shape[-1]
    batch = omega.shape[1:-3]
    half_sq = 0.5 * (y * y).sum(-1).unsqueeze(-2)  # (..., 1, M)
    chunk = max(1, _MAX_BLOCK // (num_q * y.shape[-2]))
    yt = y.transpose(-1, -2).contiguous()  # (..., D, M); a transposed view broadcast over R takes a BLAS path whose rounding depends on R
    total = total_probs = None
    for start in range(0, num_s, chunk):
        block = omega[..., start : start + chunk, :]
        s = block.shape[-2]
        flat = block.reshape(reps, *batch, num_q * s, dim)
        logits = (flat @ yt).sub_(half_sq)  # (R, ..., N s, M)
        if hidden is not None:
            # in place through an (R, ..., N, s, M) view of the fresh contiguous block: no (N s, M) mask copy
            logits.view(reps, *batch, num_q, s, logits.shape[-1]).masked_fill_(hidden.unsqueeze(-2), float("-inf"))
        probs = torch.softmax(logits, dim=-1)  # (R, ..., N s, M)
        del logits
        f = probs if v is None else probs @ v  # (R, ..., N s, Dv)
        part = _sum_samples(f, reps, batch, num_q, s)
        total = part if total is None else total + part
        if with_probabilities:
            part = _sum_samples(probs, reps, batch, num_q, s)
            total_probs = part if total_probs is None else total_probs + part
    return (total, total_probs) if with_probabilities else total


@keyword_entry(RaOptions)
def estimate(q: Any, k: Any, v: Any, draws: Draws, options: RaOptions) -> torch.Tensor:
    """Randomized attention over (R, ..., N, Dv); same signature and layout as ``ra.reference.estimate``.

    ``mask="causal"``: the mixture (eq. 29-31) and eq. 6 over the keys ``m <= n + M - N`` of each query n; still
    quadratic, the bidirectional computation with the hidden logits at -inf.
    """
    y, v, hidden, omega, num_samples = _prepared(q, k, v, draws, options)
    return _f_mean(omega, y, v, hidden=hidden) / num_samples


@keyword_entry(RaOptions)
def probabilities(q: Any, k: Any, draws: Draws, options: RaOptions) -> torch.Tensor:
    r"""The attention probabilities RA implies, ``(R, ..., N, M)``: :func:`estimate` with ``v = I_M``.

    :math:`\hat P_{n\cdot} = \frac1S \sum_s \mathrm{softmax}_m(\omega_{ns}^\top y_m - \|y_m\|^2/2)`
    (eq. 6 without the values), without the ``(N, M) x (M, M)`` product an identity would cost. Under
    ``mask="causal"`` the softmax runs over the visible keys ``m <= n + M - N`` and the hidden entries are exact
    zeros, so ``probabilities @ v`` is :func:`estimate` with the same mask (to rounding).
    """
    y, _, hidden, omega, num_samples = _prepared(q, k, k, draws, options)
    total = _f_mean(omega, y, None, hidden=hidden)  # (R, ..., N, M): in place, no second (N, M) array
    return total if num_samples == 1 else total.div_(num_samples)


@keyword_entry(RaOptions)
def estimate_with_probabilities(q: Any, k: Any, v: Any, draws: Draws, options: RaOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """``(estimate(q, k, v, ...), probabilities(q, k, ...))``, the same bits: each sample's softmax computed once."""
    y, v, hidden, omega, num_samples = _prepared(q, k, v, draws, options)
    total, total_probs = _f_mean(omega, y, v, with_probabilities=True, hidden=hidden)
    return total / num_samples, total_probs if num_samples == 1 else total_probs.div_(num_samples)


def _prepared(q: Any, k: Any, v: Any, draws: Draws, options: RaOptions):
    """``(y, v, hidden, omega, S)``: the scaled keys, the values, the mask's hidden keys and the samples."""
    x, y, v, scale, _ = prepare_batched(q, k, v, options.scale)
    hidden = _hidden(options.mask, x, y)
    omega, num_samples = _samples(x, y, draws, options, scale, hidden=hidden)
    return y, v, hidden, omega, num_samples


def _hidden(mask: str | None, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
    """``(N, M)`` boolean on ``x``'s device, True where ``mask`` (checked by :class:`RaOptions`) hides key m
    from query n (:meth:`~randattn.estimators.masks.Mask.visible_tensor`, made on the device); None for no mask."""
    visible = Mask.parse(mask).visible_tensor(x.shape[-2], y.shape[-2], x.device)
    return None if visible is None else visible.logical_not_()


def _samples(x: torch.Tensor, y: torch.Tensor, draws: Draws, options: RaOptions, scale: float,
             hidden: torch.Tensor | None = None):
    """``(omega (R, ..., N, S, D), S)``: the samples of eq. 7 (or the biased variant's, or the mean); ``scale`` resolved.

    ``hidden`` (N, M): the causal mask's hidden keys, which get mixture weight exactly 0 (eq. 29-31 over visible keys).
    """
    sigma = noise_std(options.noise, scale)
    batch = x.shape[:-2]
    num_q, dim = x.shape[-2], x.shape[-1]
    logits_pi = x @ y.transpose(-1, -2)  # (..., N, M)
    if hidden is not None:
        logits_pi = logits_pi.masked_fill(hidden, float("-inf"))  # exp gives exact zeros: hidden keys never enter
    log_pi = torch.log_softmax(logits_pi, dim=-1)
    if options.sample == "mean":
        mean = x + torch.exp(log_pi) @ y
        return mean.unsqueeze(0).expand(draws.replicates, *mean.shape).unsqueeze(-2), 1
    draws = to_torch_draws(draws, x)
    eps = check_draw_array(draws, "eps", batch, (num_q, None, dim))
    num_samples = eps.shape[-2]
    if options.variant == "biased":
        mean = x + torch.exp(log_pi) @ y
        return mean.unsqueeze(0).unsqueeze(-2) + sigma * eps, num_samples
    u = check_draw_array(draws, "u", batch, (num_q, num_samples))
    cdf = torch.cumsum(torch.exp(log_pi), dim=-1)  # (..., N, M)
    # the replicates' uniforms go into the last dim, so that one CDF per query serves all of them (no R copies
    # of the (N, M) CDF); searchsorted(right=False) counts entries strictly below u: #{m : F_nm < u}
    reps = draws.replicates
    u_rows = u.movedim(0, -2).reshape(*u.shape[1:-1], reps * num_samples).contiguous()  # (..., N, R S)
    z = torch.searchsorted(cdf, u_rows, right=False)
    if hidden is None:
        z = z.clamp_max(y.shape[-2] - 1)
    else:
        # the CDF is flat after the last visible key; u above its rounded-down total picks that key (as the reference)
        # made on the device, as masks.last_visible_key: n + (M - N) (the shapes were checked by _hidden)
        last = torch.arange(num_q, device=z.device).add_(y.shape[-2] - num_q).unsqueeze(-1)  # (N, 1)
        z = torch.minimum(z, last)
        window = Mask.parse(options.mask).window
        if window is not None:  # u = 0 would count no key: the window's first key, as the reference
            z = torch.maximum(z, last.sub(window - 1).clamp_min_(0))
    z = z.reshape(*u.shape[1:-1], reps, num_samples).movedim(-2, 0)  # (R, ..., N, S)
    y_b = y.unsqueeze(0).expand(draws.replicates, *y.shape)
    picked = torch.gather(y_b, -2, z.reshape(*z.shape[:-2], -1, 1).expand(*z.shape[:-2], z.shape[-2] * num_samples, dim))
    return x.unsqueeze(0).unsqueeze(-2) + picked.reshape(*z.shape, dim) + sigma * eps, num_samples
