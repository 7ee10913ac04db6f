"""Block-local exact attention: EVA's exact part ``E^n`` alone, renormalized (EVA app. E.1 "Local").

Deterministic; the sparse baseline that EVA and Scatterbrain add estimates to. Blocks,
prefix (CLS) keys and the N != M mapping as in :mod:`randattn.estimators.eva.partition`; with
``layout="grid"`` and ``grid="HxW"`` the blocks are ``s x s`` windows of the patch grid (``window = s^2``).
``mask="causal"``: each query sees its block's keys up to its own token (EVA app. D's ``K x K`` triangle);
1-D layouts only (a 2-D window has no causal meaning).
"""

from __future__ import annotations

from randattn.estimators import describe
from randattn.estimators.eva.partition import BLOCK_LAYOUT_VARIANTS, block_layout_facts
from randattn.estimators.base import deterministic_spec
from randattn.estimators.local import batched, reference
from randattn.estimators.local.reference import LocalOptions

#: local attention's parameters, declared once as the fields of
#: :class:`~randattn.estimators.local.reference.LocalOptions` (the windowed layout's)
PARAMS = LocalOptions.params()

SPEC = deterministic_spec(
    LocalOptions, reference, batched,
    name="local",
    summary="block-local exact attention (EVA's E^n alone, renormalized): the sparse baseline",
    source="Child et al. 2019; Xiong et al. 2021; EVA (Zheng et al. ICLR 2023) sec. 4.2, app. E.1",
    complexity="O(N W (D + Dv))",
    variants={**BLOCK_LAYOUT_VARIANTS, "window-1": {"window": 1}, "cls-only": {"window": 0, "prefix_tokens": 1},
              "grid-5x3": {"window": 4, "grid": "5x3"}},
    display_name="Local attention",
    describe=describe.local,
    convergence="none",
    cost="linear",
    normalized=True,
    **block_layout_facts("the window holds every key: local attention is softmax attention"),
    memory_hint="N W local scores per batch element",
)

#: no random variables, only the replicate count (:func:`~randattn.estimators.base.no_draws`)
draw = SPEC.draw
