"""Exact softmax attention, the ground truth (LARA sec. 2.1)."""

from __future__ import annotations

from randattn.estimators import describe
from randattn.estimators.base import deterministic_spec
from randattn.estimators.softmax import batched, reference
from randattn.estimators.softmax.reference import SoftmaxOptions

SPEC = deterministic_spec(
    SoftmaxOptions, reference, batched,
    name="softmax",
    summary="exact softmax attention (the ground truth)",
    source="Vaswani et al. 2017; LARA sec. 2.1",
    complexity="O(N M D)",
    variants={"exact": {}},
    display_name="Softmax",
    describe=describe.softmax,
    convergence="exact",
    cost="quadratic",
    masks=(None, "causal", "sliding"),
    normalized=True,
    memory_hint="the N x M scores of one batch element at a time",
)

#: no random variables, only the replicate count (:func:`~randattn.estimators.base.no_draws`)
draw = SPEC.draw
