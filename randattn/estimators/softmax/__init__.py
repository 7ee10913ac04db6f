"""Exact softmax attention, the ground truth (LARA sec. 2.1)."""

from __future__ import annotations

from typing import Any, Sequence

from randattn.estimators import describe
from randattn.estimators.base import Draws, family_spec, keyword_entry
from randattn.estimators.softmax import batched, reference
from randattn.estimators.softmax.reference import SoftmaxOptions


@keyword_entry(SoftmaxOptions, leave_out=("scale",))
def draw(q_shape: Sequence[int], k_shape: Sequence[int], *, num_samples: int | None = None, replicates: int = 1,
         rng: Any = None, options: SoftmaxOptions) -> Draws:
    """Softmax is deterministic: no random variables, only the replicate count (whatever the ``mask``)."""
    return Draws({}, replicates)


SPEC = family_spec(
    SoftmaxOptions, draw, reference, batched,
    name="softmax",
    summary="exact softmax attention (the ground truth)",
    source="Vaswani et al. 2017; LARA sec. 2.1",
    complexity="O(N M D)",
    needs_samples=False,
    is_random=lambda params: False,
    variants={"exact": {}},
    display_name="Softmax",
    describe=describe.softmax,
    convergence="exact",
    cost="quadratic",
    masks=(None, "causal"),
    normalized=True,
    memory_hint="the N x M scores of one batch element at a time",
)
