"""Nyströmformer attention as a randattn estimator plugin (Xiong et al., AAAI 2021).

``softmax(Q K^T s) V`` is approximated through ``m`` landmark queries and keys, the means of
``m`` contiguous segments of the queries and of the keys (eq. 16):
``F A^+ (B V)`` with ``F = softmax(s Q K~^T)``, ``A = softmax(s Q~ K~^T)``, ``B = softmax(s Q~ K^T)``
(eq. 13, 17) and ``A^+`` from the paper's iteration (eq. 14) or an SVD. Deterministic: ``num_samples``
is the landmark count ``m``, and ``draw`` makes no random numbers.

Registered through the entry point ``nystrom = "randattn_nystrom:SPEC"`` in the group
``randattn.estimators``; after ``pip install -e examples/randattn-nystrom``,
``randattn.get_spec("nystrom")`` finds it.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from randattn.estimators import BatchedForms, Draws, EstimatorSpec, ExactLimit, Param
from randattn_nystrom import batched, reference

__all__ = ["SPEC", "draw"]


def draw(q_shape: Sequence[int], k_shape: Sequence[int], *, num_samples: int, replicates: int = 1, rng: Any = None,
         **params: Any) -> Draws:
    """No random variables: ``landmark_slots : (R, ..., m, 0)``, a zero-size array whose shape carries R and m.

    ``estimate`` receives only the draws, so the landmark count m = ``num_samples`` travels in
    this shape (as LARA's ``sample="mean"`` does); ``rng`` is not used.
    """
    if isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer)) or num_samples < 1:
        raise ValueError(f"num_samples (the number of landmarks m) must be an integer >= 1, got {num_samples!r}")
    return Draws({"landmark_slots": np.zeros((replicates, *q_shape[:-2], int(num_samples), 0))}, replicates)


SPEC = EstimatorSpec(
    name="nystrom",
    summary="Nyström approximation of the softmax matrix through m segment-mean landmarks (deterministic)",
    source="Xiong et al. AAAI 2021 (Nyströmformer) sec. 3, eq. 13-17; EVA (Zheng et al. ICLR 2023) app. E.1 baseline",
    complexity="O((N + M) m (D + Dv) + m^3)",
    params={
        "pinv": Param("iterative", "A^+ by the paper's iteration (eq. 14, iterative) or an SVD pseudoinverse (exact)",
                      choices=reference.PINV),
        "pinv_iterations": Param(6, "iterations of eq. 14 (the paper's 6; >= 0, 0: Z_0 alone)", kind=int),
    },
    draw=draw,
    reference=reference.estimate,
    forms=BatchedForms(estimate=batched.estimate),
    needs_samples=True,
    is_random=lambda params: False,
    variants={
        "default": {},
        "pinv-exact": {"pinv": "exact"},
        "iterations-0": {"pinv_iterations": 0},
        "iterations-12": {"pinv_iterations": 12},
    },
    display_name="Nyströmformer",
    convergence="none",
    cost="linear",
    # the landmarks are segment means of the queries present: a subset of the queries is another estimator, so
    # randattn mse refuses --queries last:K or sample:K without a mask
    query_placement="proportional",
    # F A^+ B 1 = F A^+ 1 = 1 only when A is invertible and A^+ exact; the iterate Z* has no such property
    normalized=False,
    signed_weights=True,  # A^+ has negative entries: the implied weights F A^+ B can be negative
    exact_limits=(
        # rtol: F A^+ B = P P^+ P is exact in exact arithmetic, but a computed pseudoinverse errs by
        # about eps * cond(A), and cond(P) grows with N / D (the softmax of a rank-D logit matrix is
        # numerically low rank). On standard-normal inputs, 20 seeds each, N, M <= 64, D >= 3, the
        # largest error was 3e-9 of the largest output (3e-12 for N, M <= 29); 1e-6 leaves room.
        # Not reached for ill-conditioned A: huge logits (one-hot rows), duplicate landmarks, N >> D.
        ExactLimit(
            "every token of the shorter side is its own landmark and A^+ is exact: N == M gives "
            "F = A = B = P and P P^+ P = P (Xiong et al. Lemma 2); N > M gives k~ = k, F = P, B = A and "
            "P A^+ A = P, N < M gives q~ = q, F = A, B = P and A A^+ P = P, both when A is nonsingular",
            params={"pinv": "exact"},
            num_samples=lambda n, m: max(n, m),
            rtol=1e-6,
        ),
    ),
    memory_hint="the N x m and m x M landmark scores per batch element",
)
