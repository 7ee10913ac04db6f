"""Log-space SNIS skeleton in torch (batched form of ``snis.reference``)."""

from __future__ import annotations

import math

import torch

from randattn.estimators.snis import flatten_features

__all__ = ["feature_attention", "affine_feature_attention", "snis_terms_from_log_features"]


def feature_attention(
    log_qf: torch.Tensor,
    log_kf: torch.Tensor,
    v: torch.Tensor,
    *,
    q_sign: torch.Tensor | None = None,
    k_sign: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalized linear attention from log-features; see ``snis.reference.feature_attention``.

    log_qf : (..., N, S, L), log_kf : (..., M, S, L), v : (..., M, Dv) -> ((..., N, Dv), (..., N)).
    """
    lq = flatten_features(log_qf)
    lk = flatten_features(log_kf)
    if q_sign is None and k_sign is None:
        log_key_mass = torch.logsumexp(lk, dim=-2)  # (..., J)
        key_probs = torch.exp(lk - log_key_mass.unsqueeze(-2))
        f = key_probs.transpose(-1, -2) @ v  # (..., J, Dv)
        w = torch.softmax(lq + log_key_mass.unsqueeze(-2), dim=-1)  # (..., N, J)
        out = w @ f
        return out, torch.ones(out.shape[:-1], dtype=out.dtype, device=out.device)
    sq = torch.ones_like(lq) if q_sign is None else flatten_features(q_sign)
    sk = torch.ones_like(lk) if k_sign is None else flatten_features(k_sign)
    c = lk.amax(dim=-2)
    c = torch.where(torch.isfinite(c), c, torch.zeros_like(c))
    kb = sk * torch.exp(lk - c.unsqueeze(-2))
    key_num = kb.transpose(-1, -2) @ v
    key_den = kb.sum(-2)
    t = lq + c.unsqueeze(-2)
    t_max = t.amax(dim=-1, keepdim=True)
    t_max = torch.where(torch.isfinite(t_max), t_max, torch.zeros_like(t_max))
    qa = sq * torch.exp(t - t_max)
    num = qa @ key_num
    den = qa @ key_den.unsqueeze(-1)
    return num / den, torch.sign(den[..., 0])


def affine_feature_attention(
    x: torch.Tensor,
    y: torch.Tensor,
    v: torch.Tensor,
    directions: torch.Tensor,
    offset: torch.Tensor,
    *,
    with_probabilities: bool = False,
    probability_factors: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    r"""The positive-feature SNIS of :func:`feature_attention` for features ``x . W_j + a_j - |x|^2/2``.

    Same result as ``feature_attention`` on the log-features of
    ``features.batched.affine_directions`` (to rounding), computed with three matrix products,
    two fused softmaxes and two max passes over the (J, M) and (N, J) matrices:

    .. math::
        \ell^k_{jm} = W_j \cdot y_m - \|y_m\|^2/2,\quad c_j = \max_m \ell^k_{jm},\quad
        E_{jm} = e^{\ell^k_{jm} - c_j} \in (0, 1],\quad
        f_j = \frac{\sum_m E_{jm} v_m}{\sum_m E_{jm}},

    .. math::
        \log Z_j = a_j + c_j + \log\textstyle\sum_m E_{jm},\qquad
        y_n = \sum_j \mathrm{softmax}_j(x_n \cdot W_j + a_j + \log Z_j)\, f_j .

    The query term :math:`-\|x_n\|^2/2` is a constant of the softmax over j and :math:`a_j` one of
    the sum over m, so neither touches an (N, J) or (J, M) matrix;
    the keys are laid out (J, M) so that the max and the sum over m run along contiguous rows.
    Exact in log space: the largest :math:`E_{jm}` is 1, so :math:`\sum_m E_{jm} \ge 1` and it is
    recovered from the softmax as :math:`1 / \max_m \mathrm{softmax}_m` (at least 1/M); no epsilon.

    Parameters
    ----------
    x : (..., N, D)
    y : (..., M, D)
    v : (..., M, Dv) or None
        None: the identity ``I_M`` without forming it (:math:`f_j` is then row j of the key
        softmax), so the result is the implied attention probabilities.
    directions : (R, ..., J, D)
    offset : (R, ..., J)
    with_probabilities : bool
        Also return the implied probabilities (the result for ``v = None``), from the same
        query softmax: the two products are the only work they do not share.
    probability_factors : bool
        With ``with_probabilities``: return the probabilities as their two factors instead,
        the query softmax ``(R, ..., N, J)`` and the key softmax ``(R, ..., J, M)``, whose product
        they are (for :mod:`randattn.analysis.probability_error`).

    Returns
    -------
    (R, ..., N, Dv), or (R, ..., N, M) when ``v`` is None; with ``with_probabilities``, the pair
    (output, probabilities), each the same bits as its own call; with ``probability_factors``
    too, the triple (output, query softmax, key softmax)
    """
    replicates, batch = directions.shape[0], x.shape[:-2]
    n, m, d, j = x.shape[-2], y.shape[-2], x.shape[-1], directions.shape[-2]
    dv = m if v is None else v.shape[-1]
    flat = replicates * math.prod(batch) if batch else replicates

    def per_replicate(t: torch.Tensor) -> torch.Tensor:  # (..., T, F) -> (R * batch, T, F); a view when R = 1
        return t.unsqueeze(0).expand(replicates, *t.shape).reshape(flat, t.shape[-2], t.shape[-1])

    xb, yb = per_replicate(x), per_replicate(y)
    w = directions.reshape(flat, j, d)
    # the row term -|y|^2/2 rides in the product as an extra coordinate: [W_j, 1] . [y_m, -|y_m|^2/2]
    # (no separate pass over the (J, M) matrix; measured no slower than an in-place broadcast add)
    y_aug = torch.cat([yb, (yb * yb).sum(-1, keepdim=True).mul_(-0.5)], dim=-1)  # (B, M, D + 1)
    ones = w.new_ones(flat, j, 1)
    keys = torch.bmm(torch.cat([w, ones], dim=-1), y_aug.transpose(-1, -2))  # (B, J, M) key log-features - a_j
    c = keys.amax(dim=-1, keepdim=True)
    probs = torch.softmax(keys, dim=-1)  # E_jm / sum_m E_jm in one fused pass
    del keys
    # the largest entry of each row is exp(0) / sum_m E_jm: log sum_m E_jm = -log max_m probs_jm (>= 1/M, no underflow)
    log_sum = -torch.log(probs.amax(dim=-1, keepdim=True))
    f = probs if v is None else torch.bmm(probs, per_replicate(v))  # (B, J, Dv)
    if not with_probabilities:
        del probs
    # a_j enters twice: in the key mass Z_j and in the query feature itself
    log_mass = c + log_sum + 2.0 * offset.reshape(flat, j, 1)  # (B, J, 1)
    logits = torch.bmm(xb, w.transpose(-1, -2)).add_(log_mass.transpose(-1, -2))  # (B, N, J)
    query_weights = torch.softmax(logits, dim=-1)
    del logits
    out = torch.bmm(query_weights, f).reshape(replicates, *batch, n, dv)
    if not with_probabilities:
        return out
    if probability_factors:
        return out, query_weights.reshape(replicates, *batch, n, j), probs.reshape(replicates, *batch, j, m)
    return out, torch.bmm(query_weights, probs).reshape(replicates, *batch, n, m)


def snis_terms_from_log_features(
    log_qf: torch.Tensor, log_kf: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch form of :func:`randattn.estimators.snis.reference.snis_terms_from_log_features` (same layout)."""
    lx = log_qf.reshape(*log_qf.shape[:-2], -1)
    ly = log_kf.reshape(*log_kf.shape[:-2], -1)
    log_key_mass = torch.logsumexp(ly, dim=-2)
    key_probs = torch.exp(ly - log_key_mass.unsqueeze(-2))
    return lx + log_key_mass.unsqueeze(-2), key_probs.transpose(-1, -2) @ v
