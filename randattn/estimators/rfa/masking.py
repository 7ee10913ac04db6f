"""Which masks RFA computes, checked in one place for ``draw``, the reference and the batched forms."""

from __future__ import annotations

from typing import Any

from randattn.estimators.features import DATA_DEPENDENT_MAPS, FEATURE_MAPS
from randattn.estimators.masks import MASKS  # RFA computes every mask an estimator can declare (ARCHITECTURE sec. 12)

__all__ = ["MASKS", "check_rfa_mask"]


def check_rfa_mask(mask: Any, feature_map: str) -> None:
    """Raise ValueError naming ``mask`` for an unknown mask, or naming ``feature_map`` for a map with no causal form."""
    if mask not in MASKS:
        raise ValueError(f"mask={mask!r} is not allowed; choose None (bidirectional) or 'causal'")
    if mask == "causal" and feature_map in DATA_DEPENDENT_MAPS:
        causal_maps = ", ".join(repr(f) for f in FEATURE_MAPS if f not in DATA_DEPENDENT_MAPS)
        raise ValueError(
            f"feature_map={feature_map!r} has no causal form: its parameters are fitted from every query and key, "
            f"so under mask='causal' each output would depend on later tokens; choose one of {causal_maps}"
        )
