"""The shared test base: the public conformance kit over every registered estimator variant (STYLE sec. 10).

Every contract of ARCHITECTURE sec. 3 that holds for any estimator -- batched == reference with the same draws,
the optional probability forms, the replicate layout, seeded reproducibility, finiteness at ViT-like norms, clear
errors for bad input -- is a check of :mod:`randattn.testing.checks`, so that a plugin is held to it too; this file
runs those checks on each of our configurations (:func:`randattn.testing.all_variants`, plus each estimator's
defaults). What stays here is project-specific, each with the reason it is no kit check.

Cost (:data:`ESTIMATE_CHECKS`): by default every check on each estimator's defaults, and the contracts of the
estimate itself on every variant; every check on every variant with ``-m slow``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import pytest
import torch

import randattn
from randattn.estimators.base import EstimatorSpec
from randattn.testing import CHECKS, parametrize_with_checks

#: the contracts of the estimate itself: every registered variant runs them in the default run (the comparison
#: with the reference also requires the reference's and batched's shapes to agree); each estimator's defaults run
#: every check; every variant runs every check with -m slow (the layout checks, the optional probability forms, the
#: norms, keys used, the statistical and memory checks on ~130 variants would double the default run's time, and
#: their code paths are those of the defaults but for a parameter)
ESTIMATE_CHECKS = ("spec is valid", "reference == batched (float64)", "float32 batched", "bad inputs")
#: seeded reproducibility draws and estimates five times per configuration (29 s over every variant on the 2-core
#: machine): each estimator's defaults run it by default, every variant with -m slow (the draws' code paths do not
#: depend on the other parameters)
#: LARA's signed weights are the case the float32 bound at ViT-like norms guards: its variants run that check by default
SIGNED_BOUND_CHECKS = ("ViT-like norms",)


# ------------------------------------------------------------------------------------------------ patch grids
def _refit_grid(params: Mapping[str, Any], n: int, m: int) -> dict[str, Any]:
    """A patch ``grid`` refit to a call's tokens: its prefix kept (at most n - 1) and the patches as the most nearly
    square h x w grid (h the largest divisor <= sqrt, so 13 tokens with one prefix token are 3 x 4 and a prime
    count is 1 x p). A grid describes the one token set of self-attention; for N != M the configuration runs
    without it (its 1-D layout)."""
    prefix = min(params.get("prefix_tokens", 0), max(n - 1, 0))
    if n != m:
        return {**params, "grid": None, "prefix_tokens": prefix}
    patches = n - prefix
    h = max(d for d in range(1, math.isqrt(patches) + 1) if patches % d == 0)
    return {**params, "grid": (h, patches // h), "prefix_tokens": prefix}


def _grid_refitting(spec: EstimatorSpec) -> EstimatorSpec:
    """The spec with each call's ``grid`` refit to its inputs' tokens (:func:`_refit_grid`).

    Not a kit feature: a grid variant (EVA, Scatterbrain, local attention and LARA on a ViT's patch grid) fixes the
    token count to ``prefix_tokens + h w``, while the kit's checks run on shapes of their own (N = 1, N != M,
    N = M = 29, ...); the grid is a parameter of these estimators, which the kit knows nothing of. The old suite ran
    its grid variants on grids refit to the shape the same way, and skipped N != M."""

    def tokens(q, k):
        return (q[-2], k[-2]) if isinstance(q, tuple) else (q.shape[-2], k.shape[-2])

    def refit(func):
        if func is None:
            return None

        def call(*args, **params):
            return func(*args, **_refit_grid(params, *tokens(args[0], args[1])))

        return call

    forms = spec.forms.replace(estimate=refit(spec.forms.estimate),
                               **{form: refit(spec.forms.get(form)) for form in spec.forms.declared})
    return dataclasses.replace(spec, draw=refit(spec.draw), reference=refit(spec.reference), forms=forms,
                               keys_used=refit(spec.keys_used))


# ------------------------------------------------------------------------------------------------ the configurations
def _configurations() -> tuple[list[tuple[EstimatorSpec, dict]], list[tuple[EstimatorSpec, dict]]]:
    """``(defaults, others)``: each estimator's defaults, and every registered variant that resolves otherwise
    (as ``(spec, params)`` pairs for :func:`parametrize_with_checks`; grid variants through :func:`_grid_refitting`)."""
    defaults, others = [], []
    for name in randattn.list_estimators():
        spec = randattn.get_spec(name)
        defaults.append((spec, {}))
        seen = [spec.resolve_params({})]
        for params in spec.variants.values():
            resolved = spec.resolve_params(params)
            if resolved in seen:
                continue
            seen.append(resolved)
            others.append((_grid_refitting(spec) if params.get("grid") is not None else spec, dict(params)))
    return defaults, others


DEFAULTS, OTHER_VARIANTS = _configurations()

@parametrize_with_checks(DEFAULTS, checks=CHECKS)
def test_estimator_defaults_conform(estimator, check):
    check(estimator)


@parametrize_with_checks(OTHER_VARIANTS, checks=ESTIMATE_CHECKS)
def test_every_variant_conforms(estimator, check):
    check(estimator)


LARA_VARIANTS = [(spec, params) for spec, params in OTHER_VARIANTS if spec.name == "lara"]


@parametrize_with_checks(LARA_VARIANTS, checks=SIGNED_BOUND_CHECKS)
def test_lara_variants_float32_at_vit_like_norms(estimator, check):
    check(estimator)


@pytest.mark.slow
@parametrize_with_checks(
    OTHER_VARIANTS,
    checks=[name for name in CHECKS if name not in ESTIMATE_CHECKS + SIGNED_BOUND_CHECKS])
def test_every_variant_conforms_other_checks(estimator, check):
    check(estimator)


@pytest.mark.slow
@parametrize_with_checks([(spec, params) for spec, params in OTHER_VARIANTS if spec.name != "lara"],
                         checks=SIGNED_BOUND_CHECKS)
def test_every_variant_at_vit_like_norms(estimator, check):
    check(estimator)


# ------------------------------------------------------------------------------------------------ project-specific
def test_unknown_estimator_lists_known(rng):
    """The registry's lookup, not an estimator's contract."""
    q, k, v = rng.standard_normal((3, 6, 4))
    with pytest.raises(ValueError, match=r"unknown estimator 'performer'; known estimators: softmax, rfa, ra"):
        randattn.estimate("performer", q, k, v)


def test_draws_of_another_shape_are_rejected(rng):
    """The message comes from the package's own draw-shape validation (``randattn.estimators._prepare``), which a
    plugin need not use; the kit cannot ask for its words."""
    q, k, v = rng.standard_normal((3, 6, 4))
    draws = randattn.draw("rfa", (2, 6, 4), (2, 6, 4), num_samples=5, seed=0)
    with pytest.raises(ValueError, match="were the draws made for inputs of another shape"):
        randattn.get_spec("rfa").reference(q, k, v, draws)


def test_bad_backend_and_dtype(rng):
    """``randattn.estimate``'s own arguments, the same for every estimator: checked once."""
    q, k, v = rng.standard_normal((3, 6, 4))
    with pytest.raises(ValueError, match="backend='jax' is not allowed"):
        randattn.estimate("softmax", q, k, v, backend="jax")
    with pytest.raises(ValueError, match="backend='torch' only"):
        randattn.estimate("softmax", q, k, v, dtype=torch.float32)
    with pytest.raises(TypeError, match="floating torch dtype"):
        randattn.estimate("softmax", q, k, v, backend="torch", dtype=torch.int32)
