"""The plan asks the estimator's spec whether its weights are signed (and so which dtype ``auto`` picks).

The same answer for the built-ins as before the protocol, and a plugin, whose name randattn does not know, gets
its own spec's answer.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from randattn.analysis.plan import estimator_config
from randattn.estimators.registry import get_spec, register_estimator, unregister_estimator


@pytest.mark.parametrize(
    ("text", "signed"),
    [
        ("softmax", False),
        ("rfa", False),
        ("rfa:feature_map=trigonometric", True),
        ("rfa:feature_map=hyperbolic,coupling=orthogonal", False),
        ("lara", True),  # decoupled weights (eq. 38) can be negative
        ("lara:weighting=coupled", True),
        ("lara:weighting=balance", False),
        ("lara:alpha_clamp=1e-8", False),  # clipped as the official code does: all positive
        ("lara:preset=official-code", False),
        ("eva", False),
        ("local", False),
    ],
)
def test_builtin_signed_weights_and_the_auto_dtype(text, signed):
    config = estimator_config(text)
    assert config.signed_weights is signed
    assert config.torch_dtype_name("auto") == ("float64" if signed else "float32")
    assert config.torch_dtype_name("float32") == "float32"


@pytest.fixture
def plugins():
    specs = [replace(get_spec("rfa"), name="myrfa", display_name="My RFA"),
             replace(get_spec("local"), name="signedlocal", signed_weights=True)]
    for spec in specs:
        register_estimator(spec)
    yield specs
    for spec in specs:
        unregister_estimator(spec.name)


def test_a_plugin_gets_its_own_specs_answer(plugins):
    assert estimator_config("myrfa:feature_map=trigonometric").signed_weights is True
    assert estimator_config("myrfa").torch_dtype_name("auto") == "float32"
    signed = estimator_config("signedlocal")
    assert signed.signed_weights is True and signed.torch_dtype_name("auto") == "float64"
