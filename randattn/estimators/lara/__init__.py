"""Linear randomized attention, LARA (Zheng et al., ICML 2022, sec. 4 and app. G.3).

C proposals ``q_c`` built from segment landmarks (C = ``num_samples``: "landmarks, the
number of which is equal to the number of samples"), one sample ``omega_c ~ q_c`` each,
combined per query by self-normalized multiple importance sampling (eq. 10 / 28) with the
weighting functions of eq. 36-38.

The draws are data-independent common random numbers, so that ``estimate`` is pure and the
reference and batched forms consume the same draws:

- ``eps : (R, ..., C, D)`` standard Gaussian noise, ``omega_c = mu_c + sigma eps_c``;
- ``u : (R, ..., C)`` uniforms for the mixture proposal of eq. 32 only: the component
  ``z_c = #{m : F_cm < u_c}`` by inverse CDF of ``pi_c`` (as in ``ra``);
- ``sample="mean"`` draws nothing: ``proposal_slots : (R, ..., C, 0)`` is a zero-size array
  whose shape carries C (``estimate`` has no other way to know it).

Always ``C`` rows are drawn; the estimator uses the first ``C_eff`` of them
(``C_eff = min(C, N)``, and ``min(C, N, M)`` for the key-landmark proposals eq. 34, 35;
``min(C, h w)`` with a patch grid), see :func:`randattn.estimators.lara.reference.effective_proposals`.

Landmarks (``layout``, ``grid``, ``prefix_tokens``): on images the paper pools 2-D blocks of
the patch grid (app. G.4, "2D average pooling (the same as segments)"); with ``grid=(h, w)``
(or ``"HxW"``) the C landmarks are means of C non-overlapping blocks of the ``h x w`` patches,
the ``prefix_tokens`` leading tokens (CLS, registers) being in no block; without a grid, or
with ``layout="sequence"``, they are means of C contiguous 1-D segments (app. G.3.1). The
convention (block shapes, uneven grids, C not a product of divisors, prefix tokens) and its
source are in :mod:`randattn.estimators.segments`.

Precision: the batched form computes signed weightings (``decoupled``/``coupled`` without
``alpha_clamp``) in float64 whatever the input dtype (their self-normalizer cancels); pass the
draws in float64 too (``Draws.to_torch(dtype=torch.float64)``) for results equal to the
reference's on float32 activations.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from randattn._validation import check_positive_int
from randattn.estimators import describe
from randattn.estimators.base import Draws, ImportanceWeights, family_spec, keyword_entry
from randattn.estimators.lara import batched, reference, weights
from randattn.estimators.presets import LARA_PRESETS
from randattn.estimators.lara.reference import PROPOSALS, SAMPLES, WEIGHTINGS, LaraOptions

__all__ = ["PARAMS", "SPEC", "draw", "PROPOSALS", "WEIGHTINGS", "SAMPLES"]

#: LARA's parameters, declared once as the fields of :class:`~randattn.estimators.lara.reference.LaraOptions`
PARAMS = LaraOptions.params()


@keyword_entry(LaraOptions, leave_out=("scale",))
def draw(q_shape: Sequence[int], k_shape: Sequence[int], *, num_samples: int, replicates: int = 1,
         rng: np.random.Generator, options: LaraOptions) -> Draws:
    """The draws of LARA with C = ``num_samples`` proposals (see the module docstring), its keywords LARA's options.

    Returns
    -------
    Draws
        ``eps : (R, ..., C, D)``; ``u : (R, ..., C)`` for ``proposal="eq32"`` (drawn before
        ``eps``); ``proposal_slots : (R, ..., C, 0)`` only for ``sample="mean"``.
    """
    num_samples = check_positive_int("num_samples", num_samples)
    prefix = (replicates, *q_shape[:-2], num_samples)
    if options.sample == "mean":
        return Draws({"proposal_slots": np.zeros((*prefix, 0))}, replicates)
    arrays = {}
    if options.proposal == "eq32":
        arrays["u"] = rng.random(prefix)
    arrays["eps"] = rng.standard_normal((*prefix, q_shape[-1]))
    return Draws(arrays, replicates)


def _is_random(params: Mapping[str, Any]) -> bool:
    return params.get("sample", "random") != "mean"


def _variants() -> dict[str, dict[str, Any]]:
    """Every proposal x weighting, plus eval mode, the official code's noise and clipping, beta = 2, grid landmarks."""
    variants: dict[str, dict[str, Any]] = {
        f"{p}-{w}": {"proposal": p, "weighting": w} for p in PROPOSALS for w in WEIGHTINGS
    }
    variants["eq34-decoupled-mean"] = {"proposal": "eq34", "weighting": "decoupled", "sample": "mean"}
    variants["eq32-balance-mean"] = {"proposal": "eq32", "weighting": "balance", "sample": "mean"}
    variants["eq35-decoupled-beta2"] = {"proposal": "eq35", "weighting": "decoupled", "beta": 2.0}
    variants["eq34-decoupled-reference-code"] = {"proposal": "eq34", "weighting": "decoupled", "noise": "reference-code"}
    variants["eq34-decoupled-clamp"] = {"proposal": "eq34", "weighting": "decoupled", "alpha_clamp": 1e-8}
    variants["official-vit"] = {
        "proposal": "eq35", "weighting": "decoupled", "beta": 2.0, "alpha_clamp": 1e-8, "noise": "reference-code",
    }
    # 2-D landmarks (app. G.4); the grids fit the common suite's 13-token inputs, which refit them to other lengths
    variants["eq34-decoupled-grid"] = {"proposal": "eq34", "weighting": "decoupled", "grid": (3, 4), "prefix_tokens": 1}
    variants["eq35-balance-grid"] = {"proposal": "eq35", "weighting": "balance", "grid": "1x13", "prefix_tokens": 0}
    variants["eq32-coupled-grid"] = {"proposal": "eq32", "weighting": "coupled", "grid": (2, 4), "prefix_tokens": 5}
    variants["official-vit-grid"] = {**variants["official-vit"], "grid": (3, 4), "prefix_tokens": 1}
    return variants


def _convergence(params: Mapping[str, Any]) -> str:
    """Self-normalized MIS whose weighting functions sum to one over the proposals is consistent
    (LARA sec. 4, eq. 10); a clamp breaks the sum, the code's noise and the mean sample bias it."""
    if params.get("sample") == "mean" or params.get("noise") != "paper" or params.get("alpha_clamp") is not None:
        return "none"
    return "consistent"


SPEC = family_spec(
    LaraOptions, draw, reference, batched,
    name="lara",
    summary="linear randomized attention: C landmark proposals, one sample each, self-normalized MIS",
    source="Zheng et al. ICML 2022 (LARA) sec. 4, eq. 8-10, 28, app. G.3 eq. 32-38, Algorithm 3",
    complexity=(
        "O((N + M) C (D + Dv) + C^2 D); + N C^2 (coupled), + C M D (eq33, eq32), + C^2 M D (eq32 density)"
    ),
    is_random=_is_random,
    variants=_variants(),
    presets=LARA_PRESETS,
    display_name="LARA",
    describe=describe.lara,
    convergence=_convergence,
    cost="linear",
    signed_weights=weights.signed_weights,
    importance_weights=ImportanceWeights(
        reference=weights.reference_terms, batched=weights.batched_terms,
        reference_per_element=weights.reference_terms_per_element,
    ),
    mask_notes={"causal": (
        "its proposals are built from landmarks that pool every query and key, so future tokens would reach "
        "earlier outputs (the LARA blog's limitations; the official code has no causal form either)")},
    normalized=True,
    memory_hint="(N + M) C features, C proposals' densities at C samples (C^2), per batch element",
    query_placement="proportional",
)
