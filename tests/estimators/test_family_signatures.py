"""The public entry points of the families written on their options keep their hand-written keyword signatures.

Each expected signature is a stub written out literally as the function was declared before its keywords came
from the family's options class (:func:`randattn.estimators.base.keyword_entry`); the test compares names, kinds,
defaults and order, never reading the expected values back from the functions under test.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from randattn.estimators.eva import batched as eva_batched
from randattn.estimators.eva import reference as eva_reference
from randattn.estimators.local import batched as local_batched
from randattn.estimators.local import reference as local_reference
from randattn.estimators.ra import batched as ra_batched
from randattn.estimators.ra import reference as ra_reference
from randattn.estimators.rfa import batched as rfa_batched
from randattn.estimators.rfa import causal as rfa_causal
from randattn.estimators.rfa import reference as rfa_reference
from randattn.estimators.scatterbrain import batched as scatterbrain_batched
from randattn.estimators.softmax import batched as softmax_batched
from randattn.estimators.softmax import reference as softmax_reference
from randattn.estimators.scatterbrain import reference as scatterbrain_reference


def _rfa(q, k, v, draws, *, scale=None, feature_map="positive", coupling="iid", mask=None): ...
def _rfa_probabilities(q, k, draws, *, scale=None, feature_map="positive", coupling="iid", mask=None): ...
def _rfa_causal(q, k, v, draws, *, scale=None, feature_map="positive", coupling="iid", chunk_size=64): ...
def _rfa_causal_probabilities(q, k, v, draws, *, scale=None, feature_map="positive", coupling="iid"): ...

def _ra(q, k, v, draws, *, scale=None, variant="unbiased", noise="paper", sample="random", mask=None): ...
def _ra_probabilities(q, k, draws, *, scale=None, variant="unbiased", noise="paper", sample="random", mask=None): ...

def _eva(q, k, v, draws, *, scale=None, window=49, prefix_tokens=0, layout="grid", grid=None, partition="paper",
         chunk_weight="exact", add_log_chunk_size=False, proposal_mean="sum", sample="random", noise="paper",
         samples_per_chunk=1, mask=None): ...
def _eva_probabilities(q, k, draws, *, scale=None, window=49, prefix_tokens=0, layout="grid", grid=None,
                       partition="paper", chunk_weight="exact", add_log_chunk_size=False, proposal_mean="sum",
                       sample="random", noise="paper", samples_per_chunk=1, mask=None): ...

def _scatterbrain(q, k, v, draws, *, scale=None, window=49, prefix_tokens=0, layout="grid", grid=None, coupling="iid",
                  mask=None): ...
def _local(q, k, v, draws=None, *, scale=None, window=49, prefix_tokens=0, layout="grid", grid=None, mask=None): ...

def _softmax(q, k, v, draws=None, *, scale=None, mask=None): ...


SIGNATURES = [
    (rfa_reference.estimate, _rfa),
    (rfa_batched.estimate, _rfa),
    (rfa_batched.probabilities, _rfa_probabilities),
    (rfa_batched.estimate_with_probabilities, _rfa),
    (rfa_batched.estimate_with_probability_factors, _rfa),
    (rfa_causal.causal_estimate, _rfa_causal),
    (rfa_causal.causal_estimate_with_probabilities, _rfa_causal_probabilities),
    (ra_reference.estimate, _ra),
    (ra_batched.estimate, _ra),
    (ra_batched.probabilities, _ra_probabilities),
    (ra_batched.estimate_with_probabilities, _ra),
    (eva_reference.estimate, _eva),
    (eva_batched.estimate, _eva),
    # these two took ``**params`` (checked against eva.PARAMS) before; now the same keywords are spelled out
    (eva_batched.probabilities, _eva_probabilities),
    (eva_batched.estimate_with_probabilities, _eva),
    (scatterbrain_reference.estimate, _scatterbrain),
    (scatterbrain_batched.estimate, _scatterbrain),
    (local_reference.estimate, _local),
    (local_batched.estimate, _local),
    (softmax_reference.estimate, _softmax),
    (softmax_batched.estimate, _softmax),
]


@pytest.mark.parametrize("entry", [local_reference.estimate, local_batched.estimate,
                                   softmax_reference.estimate, softmax_batched.estimate])
def test_deterministic_estimate_without_draws_has_no_replicate_dimension(entry):
    """``draws`` may be left out of a deterministic estimator: the output is (..., N, Dv), as documented."""
    q = k = v = np.arange(24, dtype=np.float64).reshape(4, 6) / 24
    assert tuple(entry(q, k, v).shape) == (4, 6)
    assert tuple(entry(q, k, v, draws=None, mask="causal").shape) == (4, 6)


def _shape(function) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize("entry, hand_written", SIGNATURES,
                         ids=[f"{entry.__module__.rsplit('.', 2)[-2]}.{entry.__module__.rsplit('.', 1)[-1]}."
                              f"{entry.__name__}" for entry, _ in SIGNATURES])
def test_entry_point_signature_is_the_hand_written_one(entry, hand_written):
    assert _shape(entry) == _shape(hand_written)


def test_windowed_options_take_numpy_scalars_as_the_numbers_they_equal():
    """A window or count read back from a table is a numpy scalar: accepted as before, with the same output."""
    from randattn.estimators import eva

    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(3, 8, 4))
    draws = eva.draw(q.shape, k.shape, num_samples=2, rng=rng)
    python = dict(window=4, layout="sequence", samples_per_chunk=1, add_log_chunk_size=True, chunk_weight="mean-key")
    numpy_ = dict(python, window=np.int64(4), samples_per_chunk=np.int32(1), add_log_chunk_size=np.bool_(True))
    np.testing.assert_array_equal(eva_reference.estimate(q, k, v, draws, **numpy_),
                                  eva_reference.estimate(q, k, v, draws, **python))
    np.testing.assert_array_equal(local_reference.estimate(q, k, v, window=np.int64(4)),
                                  local_reference.estimate(q, k, v, window=4))
    with pytest.raises(TypeError):  # a bool is no window, numpy's or Python's
        local_reference.estimate(q, k, v, window=np.bool_(True))
