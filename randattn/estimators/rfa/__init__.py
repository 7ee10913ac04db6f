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
from randattn.estimators.base import Draws, ImportanceWeights, family_spec, keyword_entry
from randattn.estimators.features import DATA_DEPENDENT_MAPS, FEATURE_MAPS
from randattn.estimators.rfa import batched, reference, weights
from randattn.estimators.rfa.masking import check_rfa_mask
from randattn.estimators.rfa.options import RfaOptions
from randattn.estimators.sampling import COUPLINGS, draw_omegas

#: RFA's parameters, declared once as the fields of :class:`~randattn.estimators.rfa.options.RfaOptions`
PARAMS = RfaOptions.params()


@keyword_entry(RfaOptions, leave_out=("scale",))
def draw(q_shape: Sequence[int], k_shape: Sequence[int], *, num_samples: int, replicates: int = 1,
         rng: np.random.Generator, options: RfaOptions) -> Draws:
    """``omega : (R, ..., S, D)``, independent across replicates and batch elements.

    The draws do not depend on ``mask``; :class:`~randattn.estimators.rfa.options.RfaOptions` checks it, so that a
    map with no causal form (``oprf``, ``sderf``) fails before any work.
    """
    num_samples = check_positive_int("num_samples", num_samples)
    omega = draw_omegas(rng, (replicates, *q_shape[:-2]), num_samples, q_shape[-1], options.coupling)
    return Draws({"omega": omega}, replicates)


def _masks(params: Mapping[str, Any]) -> tuple[str | None, ...]:
    """Causal for every map whose features are fixed functions of one token (ARCHITECTURE sec. 12); not for the
    data-dependent ``oprf`` and ``sderf`` (:func:`~randattn.estimators.rfa.masking.check_rfa_mask`)."""
    return (None,) if params.get("feature_map") in DATA_DEPENDENT_MAPS else (None, "causal")


def _query_placement(params: Mapping[str, Any]) -> str:
    """``oprf`` and ``sderf`` fit their parameters to every query and key present (:func:`~randattn.estimators.
    features.reference.data_params`), so a query's estimate depends on the others, as LARA's landmarks do: its rows
    are not estimated alone (``proportional``: no blocks, no subsets without a mask); every other map is
    ``independent``."""
    return "proportional" if params.get("feature_map") in DATA_DEPENDENT_MAPS else "independent"


def _causal_note(params: Mapping[str, Any]) -> str:
    """Why this configuration has no causal form: the mask check's own words."""
    try:
        check_rfa_mask("causal", params.get("feature_map", "positive"))
    except ValueError as exc:
        return str(exc)
    return "no causal form for this configuration"


def _convergence(params: Mapping[str, Any]) -> str:
    """Self-normalized importance sampling with an unbiased kernel estimate is consistent (MSE ~ 1/S);
    plain-QR orthogonal draws are biased, and the regularized map estimates SMREG, not exp(x.y)."""
    if params.get("coupling") == "orthogonal-plain-qr" or params.get("feature_map") == "regularized":
        return "none"
    return "consistent"


SPEC = family_spec(
    RfaOptions, draw, reference, batched,
    name="rfa",
    summary="random feature attention (Performer/FAVOR+; FAVOR++ with feature_map=oprf, FAVOR# with sderf) as log-space SNIS",
    source="Choromanski et al. ICLR 2021 sec. 2.3-2.4; LARA eq. 2, 4-6; Likhosherstov et al. NeurIPS 2022 (OPRF), NeurIPS 2023 (SDERF)",
    complexity="O((N + M) S D + (N + M) S Dv)",
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
    masks=_masks,
    mask_notes={"causal": _causal_note},
    query_placement=_query_placement,
    normalized=True,
    memory_hint="(N + M) S L features and the S L x Dv key sums per batch element; causal: chunks of tokens "
                "with their S L x Dv states (never N x S L x Dv)",
)
