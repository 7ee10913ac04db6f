"""Shared fixtures: small awkward shapes and the registered estimator variants."""

from __future__ import annotations

import numpy as np
import pytest

import randattn


def all_variants() -> list[tuple[str, str, dict]]:
    """(estimator, variant name, params) for every registered estimator variant."""
    cases = []
    for name in randattn.list_estimators():
        spec = randattn.get_spec(name)
        variants = spec.variants or {"default": {}}
        for variant, params in variants.items():
            cases.append((name, variant, dict(params)))
    return cases


def variant_id(case) -> str:
    return f"{case[0]}[{case[1]}]"


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20221121)
