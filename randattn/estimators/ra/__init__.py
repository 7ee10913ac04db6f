"""Randomized attention, RA (LARA sec. 3.2, app. G.2): unbiased and biased, bidirectional or causal.

The draws are data-independent common random numbers: uniforms ``u`` that select the
mixture component by inverse CDF of ``pi_n`` inside ``estimate``, and Gaussian noise
``eps``. That keeps ``estimate`` pure and lets the reference and batched forms consume
the same draws. They do not depend on the mask either: under ``mask="causal"`` the same
``u`` selects a component of the mixture over the visible keys only (eq. 29-31 with every
sum over keys restricted to ``m <= n + M - N``), so a causal and a bidirectional run can
share one draw.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from randattn._validation import check_positive_int
from randattn.estimators import describe
from randattn.estimators.base import Draws, family_spec, keyword_entry
from randattn.estimators.ra import batched, reference
from randattn.estimators.ra.reference import NOISES, RaOptions  # noqa: F401  (NOISES: re-exported, ra.NOISES as before)
from randattn.estimators.presets import RA_PRESETS

#: RA's parameters, declared once as the fields of :class:`~randattn.estimators.ra.reference.RaOptions`
PARAMS = RaOptions.params()


@keyword_entry(RaOptions, leave_out=("scale",))
def draw(q_shape: Sequence[int], k_shape: Sequence[int], *, num_samples: int, replicates: int = 1,
         rng: np.random.Generator, options: RaOptions) -> Draws:
    """``u : (R, ..., N, S)`` uniforms (unbiased only) and ``eps : (R, ..., N, S, D)``.

    With ``sample="mean"`` nothing is random and the arrays are empty. The draws are data- and mask-independent
    (the mask acts in ``estimate``, on ``pi_n``).
    """
    num_samples = check_positive_int("num_samples", num_samples)
    prefix = (replicates, *q_shape[:-2], q_shape[-2], num_samples)
    if options.sample == "mean":
        return Draws({}, replicates)
    arrays = {}
    if options.variant == "unbiased":
        arrays["u"] = rng.random(prefix)
    arrays["eps"] = rng.standard_normal((*prefix, q_shape[-1]))
    return Draws(arrays, replicates)


def _is_random(params) -> bool:
    return params.get("sample", "random") != "mean"


def _convergence(params: Mapping[str, Any]) -> str:
    """Unbiased (LARA Prop. 3.2) with the mixture proposal and the paper's noise; otherwise biased."""
    if params.get("variant") == "unbiased" and params.get("noise") == "paper" and params.get("sample") != "mean":
        return "unbiased"
    return "none"


SPEC = family_spec(
    RaOptions, draw, reference, batched,
    name="ra",
    summary=("randomized attention: per-query samples from the mixture p_n (unbiased) or its mean-field Gaussian "
             "(biased); causal and sliding-window masks supported (mixture over each query's visible keys, still "
             "quadratic)"),
    source="Zheng et al. ICML 2022 (LARA) sec. 3.2, Prop. 3.2, app. G.2 eq. 29-31",
    complexity="O(N M (S D + D + Dv)), causal or not (the causal form masks the same N x M logits: quadratic)",
    is_random=_is_random,
    variants={
        "unbiased": {"variant": "unbiased"},
        "unbiased-reference-code": {"variant": "unbiased", "noise": "reference-code"},
        "biased": {"variant": "biased"},
        "biased-mean": {"variant": "biased", "sample": "mean"},
    },
    presets=RA_PRESETS,
    display_name="RA",
    describe=describe.ra,
    convergence=_convergence,
    cost="quadratic",
    masks=(None, "causal", "sliding"),
    normalized=True,
    memory_hint="per query, S samples against all M keys: N S M per batch element",
)
