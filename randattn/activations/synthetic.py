"""Synthetic q, k, v for tests and theory checks: Gaussian with controlled norms and temperature, and hard cases.

All functions are pure: randomness comes only from the ``rng`` argument (a numpy ``Generator``, an int seed or
None), normalised once with ``np.random.default_rng``. Arrays follow ``(..., tokens, features)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["SyntheticQKV", "gaussian_qkv", "huge_key", "near_duplicate_keys", "sink_token"]


@dataclass(frozen=True)
class SyntheticQKV:
    """Synthetic attention inputs.

    Attributes
    ----------
    q : ndarray, shape (..., N, D)
    k : ndarray, shape (..., M, D)
    v : ndarray, shape (..., M, Dv)
    scale : float
        Temperature: logits are ``scale * q . k``.
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    scale: float


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


def _nonnegative_float(name: str, value: object) -> float:
    try:
        out = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number, got {value!r}") from None
    if not np.isfinite(out) or out < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
    return out


def _gaussian_iv(batch, n, m, d, dv, q_norm, k_norm, v_std, scale):
    batch = tuple(_positive_int("batch", b) for b in (batch if isinstance(batch, tuple) else tuple(batch)))
    n, m, d = _positive_int("n", n), _positive_int("m", m if m is not None else n), _positive_int("d", d)
    dv = _positive_int("dv", dv if dv is not None else d)
    q_norm, k_norm = _nonnegative_float("q_norm", q_norm), _nonnegative_float("k_norm", k_norm)
    v_std = _nonnegative_float("v_std", v_std)
    scale = _nonnegative_float("scale", scale if scale is not None else d**-0.5)
    if scale == 0:
        raise ValueError("scale must be positive, got 0")
    return batch, n, m, d, dv, q_norm, k_norm, v_std, scale


def _with_norm(x: np.ndarray, norm: float) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True) * norm


def gaussian_qkv(
    n: int,
    d: int,
    *,
    m: int | None = None,
    dv: int | None = None,
    batch: tuple[int, ...] = (),
    q_norm: float = 1.0,
    k_norm: float = 1.0,
    v_std: float = 1.0,
    scale: float | None = None,
    rng: np.random.Generator | int | None = None,
) -> SyntheticQKV:
    """Isotropic Gaussian directions with every query of norm ``q_norm`` and every key of norm ``k_norm``.

    The logits ``scale * q . k`` then have spread ``scale * q_norm * k_norm / sqrt(D)``: the temperature knob.

    Parameters
    ----------
    n, d : int
        Queries N and feature dim D.
    m, dv : int, optional
        Keys M (default N) and value dim Dv (default D).
    batch : tuple of int
        Leading dims.
    q_norm, k_norm : float
        Euclidean norm of every query / key row.
    v_std : float
        Standard deviation of the i.i.d. Gaussian values.
    scale : float, optional
        Temperature, default ``D ** -0.5``.
    rng : Generator, int or None

    Returns
    -------
    SyntheticQKV
        ``q (*batch, N, D)``, ``k (*batch, M, D)``, ``v (*batch, M, Dv)``, float64.

    Examples
    --------
    >>> s = gaussian_qkv(5, 8, q_norm=2.0, rng=0)
    >>> s.q.shape, round(float(np.linalg.norm(s.q[0])), 6)
    ((5, 8), 2.0)
    """
    batch, n, m, d, dv, q_norm, k_norm, v_std, scale = _gaussian_iv(batch, n, m, d, dv, q_norm, k_norm, v_std, scale)
    gen = np.random.default_rng(rng)
    q = _with_norm(gen.standard_normal((*batch, n, d)), q_norm)
    k = _with_norm(gen.standard_normal((*batch, m, d)), k_norm)
    v = v_std * gen.standard_normal((*batch, m, dv))
    return SyntheticQKV(q, k, v, scale)


def huge_key(
    n: int,
    d: int,
    *,
    norm: float = 150.0,
    index: int = 0,
    rng: np.random.Generator | int | None = None,
    **kwargs,
) -> SyntheticQKV:
    """Gaussian inputs (:func:`gaussian_qkv`) with key ``index`` rescaled to norm ``norm`` (ViT keys reach 100+).

    Shapes as in :func:`gaussian_qkv`; ``kwargs`` go to it.
    """
    base = gaussian_qkv(n, d, rng=rng, **kwargs)
    norm = _nonnegative_float("norm", norm)
    index = _index_iv(index, base.k.shape[-2])
    k = base.k.copy()
    k[..., index, :] = _with_norm(k[..., index, :], norm)
    return SyntheticQKV(base.q, k, base.v, base.scale)


def near_duplicate_keys(
    n: int,
    d: int,
    *,
    copies: int = 8,
    jitter: float = 1e-3,
    rng: np.random.Generator | int | None = None,
    **kwargs,
) -> SyntheticQKV:
    """Gaussian inputs whose first ``copies`` keys are one key plus ``jitter``-sized Gaussian noise.

    Shapes as in :func:`gaussian_qkv`; ``kwargs`` go to it.
    """
    gen = np.random.default_rng(rng)
    base = gaussian_qkv(n, d, rng=gen, **kwargs)
    copies = _positive_int("copies", copies)
    jitter = _nonnegative_float("jitter", jitter)
    if copies > base.k.shape[-2]:
        raise ValueError(f"copies must be <= the number of keys {base.k.shape[-2]}, got {copies}")
    k = base.k.copy()
    k[..., :copies, :] = k[..., :1, :] + jitter * gen.standard_normal(k[..., :copies, :].shape)
    return SyntheticQKV(base.q, k, base.v, base.scale)


def sink_token(
    n: int,
    d: int,
    *,
    strength: float = 10.0,
    index: int = 0,
    rng: np.random.Generator | int | None = None,
    **kwargs,
) -> SyntheticQKV:
    """Gaussian inputs with an attention sink: key ``index`` aligned with the mean query direction.

    Queries are tilted towards a common direction; the sink key is ``mean_q * strength / (scale * |mean_q|^2)``,
    so the queries' logits on it average exactly ``strength`` (most of the attention mass for ``strength`` well above ``log M``).
    Shapes as in :func:`gaussian_qkv`; ``kwargs`` go to it.
    """
    base = gaussian_qkv(n, d, rng=rng, **kwargs)
    strength = _nonnegative_float("strength", strength)
    index = _index_iv(index, base.k.shape[-2])
    # shift queries to share a common direction so that one key can attract all of them
    direction = np.zeros(d)
    direction[0] = 1.0
    q_norm = np.linalg.norm(base.q, axis=-1, keepdims=True)
    q = _with_norm(base.q + 2.0 * q_norm * direction, 1.0) * q_norm
    mean_q = q.mean(axis=-2)
    k = base.k.copy()
    k[..., index, :] = mean_q * strength / base.scale / np.maximum(np.sum(mean_q * mean_q, -1, keepdims=True), 1e-300)
    return SyntheticQKV(q, k, base.v, base.scale)


def _index_iv(index: object, size: int) -> int:
    if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
        raise TypeError(f"index must be an int, got {type(index).__name__}")
    if not -size <= index < size:
        raise ValueError(f"index {index} is out of range for {size} keys")
    return int(index) % size
