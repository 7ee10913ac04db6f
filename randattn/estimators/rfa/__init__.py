"""Random feature attention, RFA / Performer (FAVOR+, FAVOR++), as a log-space SNIS.

LARA eq. 2 and sec. 3.1: RFA is self-normalized importance sampling of softmax attention
with the proposal N(0, I); any feature map of ``randattn.estimators.features`` and any
coupling of ``randattn.estimators.sampling`` (Performer sec. 2.3-2.4).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from randattn._validation import check_positive_int
from randattn.estimators import describe
from randattn.estimators.base import Draws, EstimatorSpec, ImportanceWeights, Param
from randattn.estimators.features import FEATURE_MAPS
from randattn.estimators.rfa import batched, reference, weights
from randattn.estimators.sampling import COUPLINGS, draw_omegas

PARAMS = {
    "feature_map": Param("positive", "random-feature map of exp(x.y)", choices=FEATURE_MAPS),
    "coupling": Param("iid", "joint law of the S directions (orthogonal-plain-qr: biased, for comparison)", choices=COUPLINGS),
}


def draw(
    q_shape: Sequence[int],
    k_shape: Sequence[int],
    *,
    num_samples: int,
    replicates: int = 1,
    rng: np.random.Generator,
    coupling: str = "iid",
    **params,
) -> Draws:
    """``omega : (R, ..., S, D)``, independent across replicates and batch elements."""
    num_samples = check_positive_int("num_samples", num_samples)
    omega = draw_omegas(rng, (replicates, *q_shape[:-2]), num_samples, q_shape[-1], coupling)
    return Draws({"omega": omega}, replicates)


def _convergence(params: Mapping[str, Any]) -> str:
    """Self-normalized importance sampling with an unbiased kernel estimate is consistent (MSE ~ 1/S);
    plain-QR orthogonal draws are biased, and the regularized map estimates SMREG, not exp(x.y)."""
    if params.get("coupling") == "orthogonal-plain-qr" or params.get("feature_map") == "regularized":
        return "none"
    return "consistent"


SPEC = EstimatorSpec(
    name="rfa",
    summary="random feature attention (Performer/FAVOR+; FAVOR++ with feature_map=oprf, FAVOR# with sderf) as log-space SNIS",
    source="Choromanski et al. ICLR 2021 sec. 2.3-2.4; LARA eq. 2, 4-6; Likhosherstov et al. NeurIPS 2022 (OPRF), NeurIPS 2023 (SDERF)",
    complexity="O((N + M) S D + (N + M) S Dv)",
    params=PARAMS,
    draw=draw,
    reference=reference.estimate,
    batched=batched.estimate,
    batched_probabilities=batched.probabilities,
    batched_with_probabilities=batched.estimate_with_probabilities,
    batched_with_probability_factors=batched.estimate_with_probability_factors,
    variants={
        f"{fm}-{coupling}": {"feature_map": fm, "coupling": coupling}
        for fm in FEATURE_MAPS
        for coupling in COUPLINGS
    },
    display_name="Performer",
    describe=describe.rfa,
    convergence=_convergence,
    cost="linear",
    signed_weights=lambda params: not weights.has_weights(params),
    importance_weights=ImportanceWeights(
        reference=weights.reference_terms, batched=weights.batched_terms,
        applies=weights.has_weights, weights_per_sample=weights.weights_per_sample,
    ),
    normalized=True,
    memory_hint="(N + M) S L features and the S L x Dv key sums per batch element",
)
