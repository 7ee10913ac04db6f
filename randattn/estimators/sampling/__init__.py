"""Random draws for random-feature estimators (numpy float64; moved to torch by ``Draws.to_torch``).

Every function takes an explicit ``numpy.random.Generator`` and a ``prefix`` shape of
leading dims (replicates and batch), and returns an array ``(*prefix, S, D)`` of
feature directions ω whose rows are each marginally ``N(0, I_D)``.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from randattn._validation import check_choice, check_positive_int

__all__ = [
    "COUPLINGS",
    "gaussian_omegas",
    "haar_orthogonal",
    "haar_stiefel",
    "orthogonal_omegas",
    "simplex_omegas",
    "draw_omegas",
    "sphere_project",
]

#: couplings between the S feature directions. ``orthogonal-plain-qr`` omits the sign fix
#: on purpose (biased; kept to reproduce peers and as a negative control).
COUPLINGS = ("iid", "orthogonal", "simplex", "orthogonal-plain-qr")


def gaussian_omegas(rng: np.random.Generator, prefix: Sequence[int], num_samples: int, dim: int) -> np.ndarray:
    """iid ``ω_s ~ N(0, I_D)``: shape ``(*prefix, S, D)`` (Performer sec. 2.3)."""
    return rng.standard_normal((*prefix, num_samples, dim))


def haar_orthogonal(rng: np.random.Generator, prefix: Sequence[int], dim: int, *, sign_fix: bool = True) -> np.ndarray:
    """Haar-distributed orthogonal matrices ``(*prefix, D, D)`` from the QR of a Gaussian matrix.

    Notes
    -----
    ``G = QR`` with Householder QR fixes ``R``'s diagonal sign by convention, which makes
    ``Q`` *not* Haar: e.g. ``E[Q_ii] < 0``. Multiplying each column of ``Q`` by
    ``sign(R_ii)`` (Mezzadri 2007) restores the Haar measure. ``sign_fix=False`` gives the
    plain, biased matrices that some implementations use.
    """
    gaussian = rng.standard_normal((*prefix, dim, dim))
    q, r = np.linalg.qr(gaussian)
    if sign_fix:
        signs = np.sign(np.diagonal(r, axis1=-2, axis2=-1))
        signs = np.where(signs == 0, 1.0, signs)
        q = q * signs[..., None, :]
    return q


def haar_stiefel(
    rng: np.random.Generator, prefix: Sequence[int], rows: int, dim: int, *, sign_fix: bool = True
) -> np.ndarray:
    """``rows`` orthonormal rows in R^D, ``(*prefix, rows, D)``, distributed as any ``rows`` rows of a Haar matrix.

    Notes
    -----
    The thin QR of a ``D x rows`` Gaussian ``G = Q R`` gives ``Q`` with orthonormal columns, uniform on the
    Stiefel manifold once each column is multiplied by ``sign(R_ii)`` (the same sign fix as
    :func:`haar_orthogonal`, Mezzadri 2007); the rows returned are those columns. Any ``rows`` rows of a Haar
    orthogonal matrix have this law (its transpose is Haar too, and the first columns of a Haar matrix are
    uniform on the Stiefel manifold), so a block of ``S < D`` orthogonal features needs an ``O(D S^2)`` thin
    QR instead of the ``O(D^3)`` QR of a full ``D x D`` matrix it would mostly discard.
    """
    gaussian = rng.standard_normal((*prefix, dim, rows))
    q, r = np.linalg.qr(gaussian)  # reduced: q (*prefix, D, rows)
    if sign_fix:
        signs = np.sign(np.diagonal(r, axis1=-2, axis2=-1))
        signs = np.where(signs == 0, 1.0, signs)
        q = q * signs[..., None, :]
    return np.swapaxes(q, -1, -2)


def _chi_norms(rng: np.random.Generator, shape: Sequence[int], dim: int) -> np.ndarray:
    """Norms of D-dim standard Gaussian vectors, ``chi_D`` distributed, drawn independently."""
    return np.sqrt(rng.chisquare(dim, size=tuple(shape)))


def _blocks(num_samples: int, dim: int) -> int:
    return -(-num_samples // dim)


def orthogonal_omegas(
    rng: np.random.Generator, prefix: Sequence[int], num_samples: int, dim: int, *, sign_fix: bool = True
) -> np.ndarray:
    """Orthogonal random features (Performer sec. 2.4, Thm. 2): ``(*prefix, S, D)``.

    Blocks of D exactly orthogonal directions (rows of a Haar orthogonal matrix) with
    independent ``chi_D`` row norms, so each row is marginally ``N(0, I)``; ``S > D`` uses
    ``floor(S / D)`` full blocks and, for the ``S mod D`` rows left, one block of that many
    orthonormal rows from a thin QR (:func:`haar_stiefel`: the law of any that many rows of a
    Haar matrix, at a fraction of the cost).
    """
    full, rest = divmod(num_samples, dim)
    parts = []
    if full:
        q = haar_orthogonal(rng, (*prefix, full), dim, sign_fix=sign_fix)  # (*prefix, B, D, D)
        parts.append(q.reshape(*prefix, full * dim, dim))
    if rest:
        parts.append(haar_stiefel(rng, prefix, rest, dim, sign_fix=sign_fix))  # (*prefix, S mod D, D)
    directions = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-2)
    norms = _chi_norms(rng, (*prefix, num_samples), dim)
    return directions * norms[..., :, None]


def simplex_directions(dim: int) -> np.ndarray:
    """D unit vectors in R^D with pairwise dot products ``-1/(D-1)`` (a regular simplex).

    ``s_i = sqrt(D / (D-1)) (e_i - 1/D)``; for D = 1 the single direction is ``[1]``.
    """
    if dim == 1:
        return np.ones((1, 1))
    eye = np.eye(dim)
    return np.sqrt(dim / (dim - 1.0)) * (eye - 1.0 / dim)


def simplex_omegas(rng: np.random.Generator, prefix: Sequence[int], num_samples: int, dim: int) -> np.ndarray:
    """Simplex random features, SimRF (Reid et al., ICML 2023): ``(*prefix, S, D)``.

    Each block of D directions is a regular simplex rotated by a Haar orthogonal matrix,
    with independent ``chi_D`` norms; each row is marginally ``N(0, I)`` and the
    directions are maximally spread (pairwise angle ``arccos(-1/(D-1))``).
    """
    blocks = _blocks(num_samples, dim)
    rotation = haar_orthogonal(rng, (*prefix, blocks), dim)  # (*prefix, B, D, D)
    directions = simplex_directions(dim) @ np.swapaxes(rotation, -1, -2)  # rows s_i^T R^T = (R s_i)^T
    norms = _chi_norms(rng, (*prefix, blocks, dim), dim)
    omegas = directions * norms[..., :, None]
    return omegas.reshape(*prefix, blocks * dim, dim)[..., :num_samples, :]


def draw_omegas(
    rng: np.random.Generator, prefix: Sequence[int], num_samples: int, dim: int, coupling: str = "iid"
) -> np.ndarray:
    """Feature directions ``(*prefix, S, D)`` under the named coupling (one of :data:`COUPLINGS`)."""
    check_choice("coupling", coupling, COUPLINGS)
    check_positive_int("num_samples", num_samples)
    check_positive_int("dim", dim)
    if coupling == "iid":
        return gaussian_omegas(rng, prefix, num_samples, dim)
    if coupling == "orthogonal":
        return orthogonal_omegas(rng, prefix, num_samples, dim)
    if coupling == "orthogonal-plain-qr":
        return orthogonal_omegas(rng, prefix, num_samples, dim, sign_fix=False)
    return simplex_omegas(rng, prefix, num_samples, dim)


def sphere_project(omega, dim: int):
    """``sqrt(D) ω / |ω|``: directions kept, norms fixed on the sphere of radius sqrt(D).

    This is the regularized softmax-kernel's distribution ``Unif(sqrt(D) S^{D-1})``
    (Performer sec. 2.3) when ω is Gaussian; works on numpy arrays and torch tensors.
    """
    norms = (omega * omega).sum(-1, keepdims=True) ** 0.5
    return omega * (dim**0.5 / norms)
