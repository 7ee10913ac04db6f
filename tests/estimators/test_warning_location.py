"""A warning raised deep inside randattn names the caller's line, whichever entry point was called: the stacklevel is
counted when warning (:func:`randattn._callers.outside_stacklevel`), not fixed for one call path.

Signed LARA (decoupled weights, eq. 38) on inputs of norm ~4 x sqrt(D) has a non-positive normalizer for some
queries (seed 0: 6 of 256 query-replicates in the reference form); its batched form reaches the warning by two
paths of different depths (the estimate, and the estimate with its probabilities)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import randattn
from randattn._callers import outside_stacklevel
from randattn.estimators.lara import batched as lara_batched
from randattn.estimators.snis import NonPositiveDenominatorWarning


def _inputs():
    rng = np.random.default_rng(0)
    q, k, v = (4 * rng.standard_normal((1, 32, 4)) for _ in range(3))
    return q, k, v


def _warnings_of(call) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        call()
    return [w for w in record if issubclass(w.category, NonPositiveDenominatorWarning)]


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_the_public_estimate_warns_at_its_caller(backend):
    q, k, v = _inputs()
    found = _warnings_of(lambda: randattn.estimate("lara", q, k, v, num_samples=8, seed=0, replicates=8,
                                                   weighting="decoupled", backend=backend))
    assert found and all(w.filename == __file__ for w in found), [(w.filename, w.lineno) for w in found]


@pytest.mark.parametrize("entry", ["estimate", "estimate_with_probabilities"])
def test_the_batched_forms_warn_at_their_caller_from_either_depth(entry):
    q, k, v = _inputs()
    draws = randattn.get_spec("lara").draw(q.shape, k.shape, num_samples=8, replicates=8,
                                            rng=np.random.default_rng(0), weighting="decoupled")
    tq, tk, tv = (torch.as_tensor(a) for a in (q, k, v))
    found = _warnings_of(lambda: getattr(lara_batched, entry)(tq, tk, tv, draws, weighting="decoupled",
                                                              layout="sequence"))
    assert found and all(w.filename == __file__ for w in found), [(w.filename, w.lineno) for w in found]


def test_outside_stacklevel_counts_the_frames_inside_the_package():
    """Called from this file (outside the package), level 1 is this function itself."""
    assert outside_stacklevel() == 1
