"""Log-space SNIS skeleton in torch (batched form of ``snis.reference``)."""

from __future__ import annotations

import torch

__all__ = ["feature_attention"]


def _flatten_features(log_f: torch.Tensor) -> torch.Tensor:
    return log_f.reshape(*log_f.shape[:-2], log_f.shape[-2] * log_f.shape[-1])


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
    lq = _flatten_features(log_qf)
    lk = _flatten_features(log_kf)
    if q_sign is None and k_sign is None:
        log_key_mass = torch.logsumexp(lk, dim=-2)  # (..., J)
        key_probs = torch.exp(lk - log_key_mass.unsqueeze(-2))
        f = key_probs.transpose(-1, -2) @ v  # (..., J, Dv)
        w = torch.softmax(lq + log_key_mass.unsqueeze(-2), dim=-1)  # (..., N, J)
        out = w @ f
        return out, torch.ones(out.shape[:-1], dtype=out.dtype, device=out.device)
    sq = torch.ones_like(lq) if q_sign is None else _flatten_features(q_sign)
    sk = torch.ones_like(lk) if k_sign is None else _flatten_features(k_sign)
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
