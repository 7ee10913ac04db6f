"""The decode-time sparse families on the options protocol: each declares its parameters once, and its entry points
and ``draw`` show the keyword signatures written out here by hand (never read back from the functions under test).

Before the options, the selection forms, vAttention's forms, ``select`` and ``draw``, and MagicPIG's reference
``probabilities`` took ``**params``; they now list the family's parameters by name, where ``**params`` stood. Every
other signature is kept exactly.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import pytest

from randattn.estimators import magicpig, quest, streaming, topk, vattention


def _layout(function: Any) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


# ---- the signatures a hand-written entry point of each family would have ----------------------------------------

def _topk_estimate(q, k, v, draws, *, scale=None, mask=None): ...
def _topk_probabilities(q, k, draws, *, scale=None, mask=None): ...
def _topk_draw(q_shape, k_shape, *, num_samples, replicates=1, rng=None, mask=None): ...


def _streaming_estimate(q, k, v, draws, *, scale=None, mask=None, sinks=4): ...
def _streaming_probabilities(q, k, draws, *, scale=None, mask=None, sinks=4): ...
def _streaming_draw(q_shape, k_shape, *, num_samples, replicates=1, rng=None, mask=None, sinks=4): ...


def _quest_estimate(q, k, v, draws, *, scale=None, mask=None, page_size=16, current_page="compete"): ...
def _quest_probabilities(q, k, draws, *, scale=None, mask=None, page_size=16, current_page="compete"): ...
def _quest_draw(q_shape, k_shape, *, num_samples, replicates=1, rng=None, mask=None, page_size=16,
                current_page="compete"): ...


def _magicpig_estimate(q, k, v, draws, *, scale=None, hash_bits=10, min_collisions=2, sinks=4, local=64,
                       center="all-keys", mask=None): ...
def _magicpig_probabilities(q, k, draws, *, scale=None, hash_bits=10, min_collisions=2, sinks=4, local=64,
                            center="all-keys", mask=None): ...
def _magicpig_draw(q_shape, k_shape, *, num_samples, replicates=1, rng, hash_bits=10, min_collisions=2, sinks=4,
                   local=64, center="all-keys", mask=None): ...

_VATTENTION = dict(budget="adaptive", sinks=128, local=128, top_k=0.1, epsilon=0.05, delta=0.05, base_rate=0.05,
                   quantile="two-sided", duplicates="count", sample_from="residual", rounding="ceil")


def _vattention_estimate(q, k, v, draws, *, scale=None, mask=None, budget="adaptive", sinks=128, local=128,
                         top_k=0.1, epsilon=0.05, delta=0.05, base_rate=0.05, quantile="two-sided",
                         duplicates="count", sample_from="residual", rounding="ceil"): ...
def _vattention_probabilities(q, k, draws, *, scale=None, mask=None, budget="adaptive", sinks=128, local=128,
                              top_k=0.1, epsilon=0.05, delta=0.05, base_rate=0.05, quantile="two-sided",
                              duplicates="count", sample_from="residual", rounding="ceil"): ...
def _vattention_draw(q_shape, k_shape, *, num_samples, replicates=1, rng, mask=None, budget="adaptive", sinks=128,
                     local=128, top_k=0.1, epsilon=0.05, delta=0.05, base_rate=0.05, quantile="two-sided",
                     duplicates="count", sample_from="residual", rounding="ceil"): ...


SIGNATURES = [
    ("topk", topk, _topk_estimate, _topk_probabilities, _topk_draw),
    ("streaming", streaming, _streaming_estimate, _streaming_probabilities, _streaming_draw),
    ("quest", quest, _quest_estimate, _quest_probabilities, _quest_draw),
    ("magicpig", magicpig, _magicpig_estimate, _magicpig_probabilities, _magicpig_draw),
    ("vattention", vattention, _vattention_estimate, _vattention_probabilities, _vattention_draw),
]


@pytest.mark.parametrize(("family", "estimate", "probabilities", "draw"), [s[1:] for s in SIGNATURES],
                         ids=[s[0] for s in SIGNATURES])
def test_selection_entry_points_have_the_hand_written_signatures(family, estimate, probabilities, draw):
    for module in (family.reference, family.batched):
        assert _layout(module.estimate) == _layout(estimate), module.__name__
        assert _layout(module.probabilities) == _layout(probabilities), module.__name__
        assert _layout(module.keys_used) == _layout(probabilities), module.__name__
    assert _layout(family.batched.estimate_with_probabilities) == _layout(estimate)
    if hasattr(family.reference, "estimate_with_probabilities"):
        assert _layout(family.reference.estimate_with_probabilities) == _layout(estimate)
    assert _layout(family.draw) == _layout(draw)
    assert family.SPEC.draw is family.draw
    if family is vattention:  # MagicPIG's select works on prepared arrays and hyperplanes, not on the options
        assert _layout(family.reference.select) == _layout(probabilities)
        assert _layout(family.batched.select) == _layout(probabilities)


def test_params_are_the_option_fields():
    assert topk.SPEC.params == {}
    assert list(streaming.SPEC.params) == ["sinks"] and streaming.PARAMS["sinks"].default == 4
    assert list(quest.SPEC.params) == ["page_size", "current_page"]
    assert quest.PARAMS["current_page"].choices == ("compete", "keep")
    assert list(magicpig.SPEC.params) == ["hash_bits", "min_collisions", "sinks", "local", "center"]
    assert magicpig.PARAMS["local"].default == 64 and magicpig.PARAMS["center"].default == "all-keys"

    assert vattention.SPEC.params == vattention.rules.PARAMS
    assert {name: p.default for name, p in vattention.PARAMS.items()} == _VATTENTION


def test_vattention_options_hold_the_checked_values():
    """A numpy count is an int, a numpy fraction a float, as ``check_params`` returns them; a bad one is named."""
    from randattn.estimators.vattention.rules import VattentionOptions

    options = VattentionOptions(sinks=np.int64(3), top_k=np.float64(0.25))
    assert type(options.sinks) is int and type(options.top_k) is float
    assert options.parameters == {**_VATTENTION, "sinks": 3, "top_k": 0.25}
    with pytest.raises(ValueError, match="mask='full' is not allowed; choose one of None, 'causal', 'sliding:W'"):
        VattentionOptions(mask="full")
    with pytest.raises(ValueError, match="epsilon must be in \\(0, 1\\)"):
        VattentionOptions(epsilon=1.0)


def test_magicpig_helpers_kept_public_check_through_the_options():
    """``check_params`` and ``checked_selection_params`` still answer as before (ints, the ``select`` keywords)."""
    from randattn.estimators.magicpig.reference import check_params, checked_selection_params

    assert check_params(hash_bits=3, min_collisions=2, sinks=1, local=0, center="none", tables=5) == (3, 2, 1, 0, 5)
    with pytest.raises(ValueError, match="min_collisions=3 exceeds the number of hash tables L = num_samples = 2"):
        check_params(hash_bits=3, min_collisions=3, sinks=1, local=0, center="none", tables=2)
    params = dict(hash_bits=3, min_collisions=2, sinks=1, local=0, center="none")
    assert checked_selection_params((1, 5, 3, 4), params) == {"min_collisions": 2, "sinks": 1, "local": 0,
                                                              "center": "none"}
    with pytest.raises(ValueError, match="the draws hold 4 hyperplanes per table but hash_bits=3"):
        checked_selection_params((1, 5, 4, 4), params)


def test_a_wrong_keyword_names_the_form_and_the_keyword():
    q, k, v = np.ones((4, 3)), np.ones((5, 3)), np.ones((5, 2))
    draws = streaming.draw(q.shape, k.shape, num_samples=6)
    with pytest.raises(TypeError, match="sinkz"):
        streaming.reference.estimate(q, k, v, draws, sinkz=2)
    with pytest.raises(TypeError, match="page_size"):
        topk.reference.estimate(q, k, v, draws, page_size=2)
    with pytest.raises(TypeError, match="draw\\(\\).*sinkz"):
        streaming.draw(q.shape, k.shape, num_samples=6, sinkz=2)
    with pytest.raises(TypeError, match="draw\\(\\).*scale"):  # draw takes no scale, as before
        topk.draw(q.shape, k.shape, num_samples=6, scale=1.0)
    with pytest.raises(ValueError, match="mask='full' is not allowed"):
        quest.draw(q.shape, k.shape, num_samples=16, mask="full")


def test_the_former_check_params_warns_and_still_checks():
    with pytest.warns(DeprecationWarning, match="StreamingOptions\\(\\*\\*params\\).check_budget\\(budget\\)"):
        check = streaming.reference.check_params
        check(8, sinks=2)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="S=24 must be a multiple of page_size=16"):
        quest.reference.check_params(24)
    with pytest.warns(DeprecationWarning):
        topk.reference.check_params(None)
    with pytest.raises(AttributeError):
        topk.reference.no_such_name  # noqa: B018
