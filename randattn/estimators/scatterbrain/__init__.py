"""Scatterbrain (Chen et al., NeurIPS 2021) in EVA's form (app. G.5, eq. 29-30).

Positive random features with omega ~ N(0, I) (S samples, any coupling of
``randattn.estimators.sampling``) off the local support, exact scores on it (EVA's local
block plus prefix keys), renormalized. Draws ``omega : (R, ..., S, D)`` as for RFA. With
``layout="grid"`` and ``grid="HxW"`` the local blocks are EVA's ``s x s`` windows (``window = s^2``).
``mask="causal"``: the visible part of the block exactly and random features over the body keys
before it (causal EVA's structure, app. D); 1-D layouts only.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from randattn.estimators import describe
from randattn.estimators.eva.partition import BLOCK_LAYOUT_VARIANTS, block_layout_facts
from randattn.estimators.base import Draws, family_spec, keyword_entry
from randattn.estimators import rfa
from randattn.estimators.scatterbrain import batched, reference
from randattn.estimators.scatterbrain.reference import ScatterbrainOptions

#: Scatterbrain's parameters, declared once as the fields of
#: :class:`~randattn.estimators.scatterbrain.reference.ScatterbrainOptions`
PARAMS = ScatterbrainOptions.params()


@keyword_entry(ScatterbrainOptions, leave_out=("scale",))
def draw(q_shape: Sequence[int], k_shape: Sequence[int], *, num_samples: int, replicates: int = 1,
         rng: np.random.Generator, options: ScatterbrainOptions) -> Draws:
    """The same random variables as RFA, ``omega : (R, ..., S, D)``, shared by every local block.

    They do not depend on ``mask``; a grid layout under ``mask="causal"`` is refused by
    :class:`~randattn.estimators.scatterbrain.reference.ScatterbrainOptions` already.
    """
    return rfa.draw(q_shape, k_shape, num_samples=num_samples, replicates=replicates, rng=rng,
                    coupling=options.coupling)


SPEC = family_spec(
    ScatterbrainOptions, draw, reference, batched,
    name="scatterbrain",
    summary="Scatterbrain: positive random features off the local block, exact scores on it, renormalized",
    source="Chen et al. NeurIPS 2021; EVA (Zheng et al. ICLR 2023) app. G.5 eq. 29-30",
    complexity="O(N W (D + Dv) + G M S D + N S (D + Dv)), G = ceil(M / W) local blocks",
    variants={**BLOCK_LAYOUT_VARIANTS, "window-4-orthogonal": {"window": 4, "coupling": "orthogonal"},
              "no-window": {"window": 0}, "grid-3x5-orthogonal": {"window": 4, "grid": "3x5", "coupling": "orthogonal"}},
    display_name="Scatterbrain",
    describe=describe.scatterbrain,
    convergence="none",
    cost="quadratic",
    normalized=True,
    **block_layout_facts("the local window holds every key, so every score is exact (EVA app. G.5)"),
    memory_hint="N W local scores and (N + M) S features per batch element; every block re-chunks the keys",
)
