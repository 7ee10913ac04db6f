r"""The squared error of low-rank implied probabilities, without forming them.

RFA with positive features and LARA imply attention probabilities of rank J,
:math:`\hat P = L R` with ``L (N, J)`` and ``R (J, M)``: for RFA the query softmax over the
features and the key softmax (LARA eq. 6, the SNIS of ARCHITECTURE sec. 4); for LARA
:math:`W^\top / d` and the key exponentials :math:`E` of eq. 28. The sweep's probability MSE needs
only the row errors :math:`e_n^2 = \|\hat P_n - P_n\|_2^2`, and

.. math::
    e_n^2 = L_n^\top (R R^\top) L_n - 2\, L_n^\top (R P_n^\top) + \|P_n\|_2^2

takes :math:`2JM(J + N) + 2NJ^2` flops per replicate and no ``(N, M)`` array. The dense pass
writes :math:`NM` entries per replicate and passes over them twice more (subtract, norm), so at
small J it is bound by memory traffic, not by its :math:`2NJM` flops. The product with the exact
probabilities is one ``(R J, M) x (M, N)`` GEMM per head over all R replicates.

The expansion cancels where :math:`\hat P \approx P`, so every result comes with a rigorous
bound on its rounding (:func:`factored_sq_errors`), and the sweep takes it only where the bound
is negligible against the error it measures (:func:`factored_rounding_negligible`): first in
float32, then, for a block whose errors are too small for float32's bound (LARA on early layers,
say), from the same factors in float64, whose bound is 2^29 times smaller; only where both fail
does it form :math:`\hat P` as before.

The formed probabilities' row errors (:func:`row_errors`) and the bound test of an estimator's
float32 probability product in a float64 run (:func:`probability_rounding_negligible`) live here
too; :mod:`~randattn.analysis.estimate_block` chooses among the three ways.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from randattn.estimators.masks import Mask

if TYPE_CHECKING:  # torch is imported by the functions that need it: plotting and reporting never load it
    import torch

__all__ = ["tiled_sq_errors", "factored_sq_errors", "factored_rounding_negligible", "factored_pays", "probability_rounding_negligible",
           "row_errors"]

#: unit roundoff and a bound on the absolute error of a product or conversion that underflows (half the smallest
#: subnormal for float32; the smallest subnormal itself for float64, whose half is not a float), per working dtype
_ROUNDING = {"float32": (2.0**-24, 2.0**-150), "float64": (2.0**-53, 2.0**-1074)}
_U64 = 2.0**-53

#: the factored pass is taken where ``RANK_FRACTION * J <= N``. Measured on the 2-core benchmark machine, float32,
#: 8 replicates x 6 heads, J = 16 / 32 / 64 / 128, the pass alone (factored against dense, ms): N = 785: 9 / 20 / 47 / 96
#: against 33 / 38 / 60 / 91; N = 577: 4 / 9 / 19 / 46 against 17 / 19 / 22 / 35; N = 197: 0.8 / 1.5 / 4.8 / 12
#: against 0.9 / 1.5 / 2.2 / 4.4 (the dense (N, M) blocks stay in cache there). In the sweep (whole units of RFA and
#: LARA on DINOv2, the two ways interleaved, best of 3) the factored units were 1.1-1.4x faster at J = 16 and 32 on
#: 577 and 785 tokens, and 0.7-1.05x at J = 64: the crossover lies between N / 16 and N / 8
RANK_FRACTION = 16

#: the bound's factor 1.01 for rounding the bound's own terms holds while K u <= 1e-3 (K = M + 2J + 6, below)
_MAX_KU = 1e-3


def tiled_sq_errors(columns, q, k, log_normaliser, *, scale: float, mask: str | None, key_tile: int):
    r"""float64 ``(R, C)``: :math:`\sum_n \sum_m (\hat P_{nm} - P_{nm})^2`, one tile of keys at a time.

    .. math:: \sum_{t} \sum_n \sum_{m \in T_t} (\hat P_{nm} - e^{s_{nm} - \log Z_n} [m \in V_n])^2

    over key tiles :math:`T_t` of ``key_tile`` keys: the exact block from the log-normaliser
    (:func:`~randattn.estimators.softmax.tiled.tiled_probabilities`), the estimator's from ``columns``. The terms
    are those of the dense sum, summed in another order (float64: the two agree to about 1e-13 relative).

    Parameters
    ----------
    columns : callable
        ``(k0, k1) -> (R, C, K, k1 - k0)``: the estimator's probabilities of keys ``k0..k1`` (a tensor in any
        float dtype, or a numpy array on the reference backend).
    q : (C, K, D), k : (C, M, D)
        float64 (tensors on the log-normaliser's device, or numpy arrays).
    log_normaliser : (C, K) float64 tensor
    scale : float
    mask : None, "causal" or "sliding:W"
        The key tiles that precede every query's window are not formed: their exact probabilities are 0.
    key_tile : int
    """
    import numpy as np
    import torch

    from randattn.estimators.softmax.tiled import tiled_probabilities

    m = k.shape[-2]
    # a tile before every query's window holds exact zeros: its terms are the estimator's own squares, the same
    # bits as est - 0, and none at all where the estimator gives those keys no weight (adding 0 changes no bit):
    # a 32,768-token window layer in blocks of 1,024 queries forms 7 of 128 tiles of 256 keys
    first_seen = Mask.parse(mask).first_visible_key(q.shape[-2], m)
    device = log_normaliser.device
    total = None
    for k0 in range(0, m, key_tile):
        k1 = min(k0 + key_tile, m)
        est = columns(k0, k1)
        if isinstance(est, np.ndarray):
            est = torch.from_numpy(est)
        if k1 <= first_seen and not bool(est.any()):
            continue
        diff = est.to(device=device, dtype=torch.float64)
        if k1 > first_seen:
            diff = diff.sub_(tiled_probabilities(q, k, log_normaliser, query_slice=slice(None),
                                                 key_slice=slice(k0, k1), scale=scale, mask=mask))
        part = torch.linalg.vecdot(diff.flatten(-2), diff.flatten(-2))  # (R, C), one pass
        total = part if total is None else total.add_(part)
        del est, diff
    return total.cpu().numpy()  # the last tile holds the last query's own key: always formed


def factored_pays(rank: int | None, queries: int) -> bool:
    """Whether the factored pass is the faster one for rank ``rank`` (at most J) and N = ``queries`` (see RANK_FRACTION)."""
    return rank is not None and RANK_FRACTION * rank <= queries


def factored_sq_errors(left: torch.Tensor, right: torch.Tensor, exact: torch.Tensor,
                       exact_sq_norms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Squared Frobenius errors :math:`\sum_n \|L_n R - P_n\|_2^2` per replicate and batch element, and a bound.

    Parameters
    ----------
    left : (R, ..., N, J) float32 or float64
        :math:`L`, any sign.
    right : (R, ..., J, M), the same dtype
        :math:`R`, entries in [0, 1] (a key softmax, or exponentials shifted to at most 1).
    exact : (..., N, M), the same dtype
        The exact probabilities rounded to that dtype (entries in [0, 1], rows summing to 1).
    exact_sq_norms : (..., N) float64
        :math:`\|P_n\|_2^2` of the full-precision probabilities.

    Returns
    -------
    sq : (R, ...) float64
        :math:`\tilde S = \sum_n \tilde e_n^2`, the computed squared error.
    bound : (R, ...) float64
        :math:`|\tilde S - S| \le` ``bound``, where :math:`S = \sum_n \|L_n R - P_n\|_2^2` exactly,
        for the given :math:`L, R` and the float64 :math:`P` (inf where it cannot be
        bounded: M too large for the bound's form, overflow; NaN propagates).

    Notes
    -----
    The products :math:`G = R R^\top`, :math:`X = R \tilde P^\top`, :math:`Q_n = L_n^\top G L_n`
    and :math:`C_n = L_n^\top X_{:n}` run in the inputs' dtype; :math:`\tilde e_n^2 = Q_n - 2 C_n + \|P_n\|^2`
    and the sum over n in float64. Every term of :math:`Q_n` is a product
    :math:`L_{nj} L_{nk} R_{jm} R_{km}` accumulated through three inner products (lengths M, J, J);
    every term of :math:`C_n` a product :math:`L_{nj} R_{jm} \tilde P_{nm}` through two (M, J).
    Counting also up to two roundings of each :math:`L` entry and one of each :math:`R` and
    :math:`P` entry by the caller (a reciprocal and a product, conversions to float32), each term
    carries at most :math:`K = M + 2J + 6` relative roundings, so by Higham, *Accuracy and
    Stability of Numerical Algorithms* (2nd ed.), lemma 3.1 and eq. 3.5,

    .. math::
        |\tilde Q_n - Q_n| + 2 |\tilde C_n - C_n| \le \gamma_K (|L_n|^\top G |L_n| + 2 |L_n|^\top X_{:n})
        + 4\eta\,(M \|L_n\|_1^2 + (2M + J + 1) \|L_n\|_1 + 2J),

    with :math:`\gamma_K = Ku / (1 - Ku)`, :math:`u = 2^{-24}` (float32) or :math:`2^{-53}` (float64); the
    :math:`\eta` terms (:math:`2^{-150}`, or :math:`2^{-1074}`) bound
    the absolute error of every product or conversion that underflows (with :math:`0 \le R \le 1`
    and :math:`\sum_m P_{nm} = 1`, each inner product of length M contributes at most
    :math:`M\eta` per entry of G or X). Since :math:`G, X \ge 0` the magnitudes are the
    computed :math:`\tilde Q_n, \tilde C_n` themselves when :math:`L \ge 0`, and are formed with
    :math:`|L|` otherwise; computing them in the working precision costs a factor at most
    :math:`(1 - \gamma_K)^{-2} \le 1.01` while :math:`Ku \le 10^{-3}`. The float64 combination and
    sum add at most :math:`1.01 (N + 4) u_{64}` times the row's magnitudes.
    """
    import torch

    if left.dtype not in (torch.float32, torch.float64) or right.dtype != left.dtype or exact.dtype != left.dtype:
        raise TypeError("factored_sq_errors computes in float32 or float64, all three factors alike; "
                        f"got {left.dtype}, {right.dtype}, {exact.dtype}")
    u, eta = _ROUNDING[str(left.dtype).removeprefix("torch.")]
    if right.numel() and not bool(((right >= 0) & (right <= 1)).all()):
        raise ValueError("factored_sq_errors needs the right factor's entries in [0, 1] (its bound assumes them)")
    reps, batch = left.shape[0], left.shape[1:-2]
    n, j, m = left.shape[-2], left.shape[-1], right.shape[-1]
    cells = int(torch.tensor(batch).prod()) if batch else 1
    lf = left.reshape(reps, cells, n, j)
    rf = right.reshape(reps, cells, j, m)
    pf = exact.reshape(cells, n, m)
    gram = rf @ rf.transpose(-1, -2)  # (R, C, J, J)
    # R P^T of every replicate at once: per head one (R J, M) x (M, N) product, P read once
    stacked = rf.transpose(0, 1).reshape(cells, reps * j, m)
    cross_t = torch.bmm(stacked, pf.transpose(-1, -2)).view(cells, reps, j, n).transpose(0, 1)  # (R, C, J, N)
    quad = (lf @ gram).mul_(lf).sum(-1)  # (R, C, N)
    cross = (lf.transpose(-1, -2) * cross_t).sum(-2)
    norms = exact_sq_norms.reshape(1, cells, n).to(torch.float64)
    rows = quad.to(torch.float64) - 2.0 * cross.to(torch.float64) + norms
    if bool((lf < 0).any()):
        magnitude = lf.abs()
        quad_abs = (magnitude @ gram).mul_(magnitude).sum(-1).to(torch.float64)
        cross_abs = (magnitude.transpose(-1, -2) * cross_t).sum(-2).to(torch.float64)
        l1 = magnitude.sum(-1, dtype=torch.float64)
    else:
        quad_abs, cross_abs = quad.to(torch.float64), cross.to(torch.float64)
        l1 = lf.sum(-1, dtype=torch.float64)
    k = m + 2 * j + 6
    gamma = k * u / (1.0 - k * u)
    size = quad_abs + 2.0 * cross_abs
    row_bounds = (1.01 * gamma * size + 4.0 * eta * (m * l1 * l1 + (2 * m + j + 1) * l1 + 2 * j)
                  + 1.01 * (n + 4) * _U64 * (size + norms))
    bound = row_bounds.sum(-1)
    if k * u > _MAX_KU:
        bound = torch.full_like(bound, float("inf"))
    return rows.sum(-1).reshape(reps, *batch), bound.reshape(reps, *batch)


def factored_rounding_negligible(sq: torch.Tensor, bound: torch.Tensor, rtol: float) -> bool:
    r"""Whether every computed squared error is within ``rtol`` of the exact one, by its bound.

    With :math:`|\tilde S - S| \le b`, the test :math:`b \le \mathrm{rtol}\,(\tilde S - b)` gives
    :math:`|\tilde S - S| \le \mathrm{rtol}\, S`. NaN or inf anywhere fails it.
    """
    import torch

    return bool((torch.isfinite(sq) & torch.isfinite(bound) & (bound <= rtol * (sq - bound))).all())


def row_errors(probs: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """float64 ``|P_hat_n - P_n|`` per row ``(R, C, N)``, overwriting ``probs`` (the run's dtype, no float64 copy).

    Parameters
    ----------
    probs : (R, C, N, M) tensor
        The estimator's implied probabilities, in the run's dtype; overwritten with the difference.
    exact : (C, N, M) tensor
        The exact probabilities in ``probs``' dtype.

    Notes
    -----
    The exact P rounded to float32 is off by <= 6e-8 P, negligible against an estimator's |P_hat - P|. Each row's
    norm is taken in the run's dtype (each row alone, whatever the block); sum(dtype=float64) over the block would
    convert it whole (20x slower).
    """
    import torch

    return torch.linalg.vector_norm(probs.sub_(exact), dim=-1).to(torch.float64)  # one fused pass; rounding ~1e-8


def probability_rounding_negligible(row_err: torch.Tensor, bound: torch.Tensor, exact_norms: torch.Tensor,
                                    rtol: float) -> bool:
    r"""Whether rounding moves every (replicate, cell)'s probability squared error by at most ``rtol`` of it.

    ``row_err (R, C, N)`` are the computed :math:`\tilde e_n = \|\tilde P_n - \mathrm{fl_{32}}(P_n)\|_2`,
    ``bound (R, C, N)`` bounds :math:`\|\tilde P_n - \hat P_n\|_2` (the estimator's product rounding) and
    ``exact_norms (C, N)`` are :math:`\|\mathrm{fl_{32}}(P_n)\|_2`. With
    :math:`\delta_n = b_n + 1.01\,u \|P_n\|_2` (also the exact probabilities' rounding to float32,
    :math:`u = 2^{-24}`), the exact :math:`e_n = \|\hat P_n - P_n\|_2` lies within :math:`\delta_n` of
    :math:`\tilde e_n`, so :math:`|\sum_n \tilde e_n^2 - \sum_n e_n^2| \le \sum_n \delta_n (2 \tilde e_n + \delta_n)`
    and :math:`\sum_n e_n^2 \ge \sum_n \max(\tilde e_n - \delta_n, 0)^2`; the test is that the first is at most
    ``rtol`` times the second. The float32 difference and norm round relative to :math:`\tilde e_n` only, as in
    every float32 run. A NaN or inf anywhere fails the test.
    """
    delta = bound + 1.01 * 2.0**-24 * exact_norms.to(bound.dtype)
    change = (delta * (2.0 * row_err + delta)).sum(-1)
    floor = (row_err - delta).clamp(min=0.0).square().sum(-1)
    return bool((change <= rtol * floor).all())
