r"""Nyströmformer attention in numpy float64: the paper's equations, literally.

Xiong et al., "Nyströmformer: A Nyström-based Algorithm for Approximating Self-Attention",
AAAI 2021, sec. "Linearized Self-Attention via Nyström Method" (eq. 13-17).

Landmarks (eq. 16, "segment-means"): the ``T`` tokens are split into ``c`` contiguous segments
with offsets :math:`b_j = \lfloor j T / c \rfloor`, ``j = 0..c``; segment sizes differ by at most
one. The paper assumes ``c | T`` (segments of ``l = T / c`` tokens, as the official code's
``reshape``); this rule agrees with it then, and uses every token exactly once otherwise.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from randattn.estimators import Draws

__all__ = ["PINV", "check_inputs", "num_landmarks", "segment_bounds", "iterative_pinv", "estimate"]

#: how ``A^+`` is computed: the paper's iteration (eq. 14) or an SVD pseudoinverse
PINV = ("iterative", "exact")


def check_inputs(q: Any, k: Any, v: Any, scale: float | None, pinv: str, pinv_iterations: int) -> tuple[tuple[int, ...], float]:
    """Validate shapes ``(..., N, D)``, ``(..., M, D)``, ``(..., M, Dv)`` and options; return ``(batch, scale)``."""
    if any(len(a.shape) < 2 for a in (q, k, v)):
        raise ValueError("q, k and v must have shape (..., tokens, features)")
    if not q.shape[:-2] == k.shape[:-2] == v.shape[:-2]:
        raise ValueError(f"q, k, v must have the same batch dims, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        raise ValueError(f"need q (..., N, D), k (..., M, D), v (..., M, Dv); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        raise ValueError("empty sequence: N and M must be >= 1")
    if pinv not in PINV:
        raise ValueError(f"pinv={pinv!r} is not allowed; choose one of {', '.join(map(repr, PINV))}")
    if isinstance(pinv_iterations, bool) or not isinstance(pinv_iterations, int) or pinv_iterations < 0:
        raise ValueError(f"pinv_iterations must be an integer >= 0, got {pinv_iterations!r}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    return tuple(q.shape[:-2]), scale


def num_landmarks(draws: Draws, batch: tuple[int, ...]) -> int:
    """``m`` as drawn: the landmark axis of the zero-size ``landmark_slots : (R, ..., m, 0)``."""
    shape = tuple(draws["landmark_slots"].shape)
    if shape[:-2] != (draws.replicates, *batch) or shape[-1] != 0:
        raise ValueError(f"draws['landmark_slots'] has shape {shape}, expected (R, *{batch}, m, 0): "
                         "were the draws made for inputs of another shape?")
    return shape[-2]


def segment_bounds(length: int, count: int) -> list[int]:
    r"""Offsets :math:`b_j = \lfloor j\,T / c \rfloor`, ``j = 0..c``, of ``c`` contiguous segments of ``T`` tokens."""
    return [j * length // count for j in range(count + 1)]


def _segment_means(x: np.ndarray, count: int) -> np.ndarray:
    """Landmarks ``(..., c, D)`` of ``x : (..., T, D)``: the mean of each segment (eq. 16)."""
    b = segment_bounds(x.shape[-2], count)
    return np.stack([x[..., b[j]:b[j + 1], :].mean(-2) for j in range(count)], axis=-2)


def _softmax(logits: np.ndarray) -> np.ndarray:
    """Row softmax; the row max is subtracted first, so logits of any size give no overflow."""
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def iterative_pinv(a: np.ndarray, iterations: int) -> np.ndarray:
    r"""The Moore-Penrose inverse of ``a : (..., c, c)`` by the iteration of eq. 14 (Razavi et al. 2014).

    .. math:: Z_0 = A^\top / (\|A\|_1 \|A\|_\infty), \qquad
              Z_{j+1} = \tfrac14 Z_j \bigl(13 I - A Z_j (15 I - A Z_j (7 I - A Z_j))\bigr),

    with :math:`\|A\|_1` the largest column sum and :math:`\|A\|_\infty` the largest row sum of
    :math:`|A|` (the paper, after Pan and Schreiber 1991), per matrix of the stack. The official
    code divides by the largest column sum only, the same here since softmax rows sum to one.
    """
    z = np.swapaxes(a, -1, -2) / (np.abs(a).sum(-2).max(-1) * np.abs(a).sum(-1).max(-1))[..., None, None]
    eye = np.eye(a.shape[-1])
    for _ in range(iterations):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


def estimate(
    q: Any, k: Any, v: Any, draws: Draws, *, scale: float | None = None, pinv: str = "iterative", pinv_iterations: int = 6
) -> np.ndarray:
    r"""Nyströmformer attention :math:`\hat S V` (eq. 17), deterministic.

    .. math:: \hat S V = \underbrace{\mathrm{softmax}(s\, Q \tilde K^\top)}_{F\ (N \times c)}\,
              \underbrace{\mathrm{softmax}(s\, \tilde Q \tilde K^\top)^+}_{A^+\ (c \times c)}\,
              \underbrace{\mathrm{softmax}(s\, \tilde Q K^\top)}_{B\ (c \times M)}\, V

    (eq. 13; with ``A^+`` replaced by the iterate ``Z*`` of eq. 14 this is eq. 15). ``B V`` is
    formed first, so no ``N x M`` array exists: time ``O((N + M) c (D + Dv) + c^3)``.

    Parameters
    ----------
    q : (..., N, D)
    k : (..., M, D)
    v : (..., M, Dv)
    draws : Draws
        From ``SPEC.draw``: ``landmark_slots : (R, ..., m, 0)`` carries R and the landmark count
        m, of which ``c = min(m, N, M)`` are used (more would leave segments empty).
    scale : float, optional
        Temperature ``s``; default ``D ** -0.5`` (the paper's ``1 / sqrt(d_q)``).
    pinv : {"iterative", "exact"}
        ``iterative``: eq. 14 from ``Z_0``; ``exact``: ``numpy.linalg.pinv`` with singular values
        below ``c eps`` of the largest dropped (``torch.linalg.pinv``'s default cutoff in float64,
        so the batched form agrees).
    pinv_iterations : int
        Iterations of eq. 14 (the paper's 6); 0 returns ``Z_0``.

    Returns
    -------
    (R, ..., N, Dv) float64, the same output for every replicate.
    """
    q, k, v = (np.asarray(a.detach().cpu() if hasattr(a, "detach") else a, dtype=np.float64) for a in (q, k, v))
    batch, scale = check_inputs(q, k, v, scale, pinv, pinv_iterations)
    c = min(num_landmarks(draws, batch), q.shape[-2], k.shape[-2])
    q_lm, k_lm = _segment_means(q, c), _segment_means(k, c)  # eq. 16
    t = lambda x: np.swapaxes(x, -1, -2)  # noqa: E731
    f = _softmax(scale * q @ t(k_lm))  # (..., N, c)
    a = _softmax(scale * q_lm @ t(k_lm))  # (..., c, c)
    b = _softmax(scale * q_lm @ t(k))  # (..., c, M)
    if pinv == "exact":
        z = np.linalg.pinv(a, rcond=c * np.finfo(np.float64).eps)
    else:
        z = iterative_pinv(a, pinv_iterations)
    out = f @ (z @ (b @ v))  # eq. 17, the c-sized products first
    return np.broadcast_to(out, (draws.replicates, *out.shape)).copy()
