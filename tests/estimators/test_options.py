"""The narrow protocol's pieces: a family's options declared once, its keyword entry points built from them.

Expected values are written out by hand (the signature a hand-written entry point would have, the errors Python
itself gives for a wrong call), never read back from the functions under test.
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass

import pytest

from randattn.estimators.base import BatchedForms, EstimatorOptions, Param, keyword_entry, option


def _toy_family():
    """A toy family, built when a test runs (not at import, so that a mutation tool's switch reaches the builders)."""

    @dataclass(frozen=True, kw_only=True)
    class ToyOptions(EstimatorOptions):
        kind: str = option("a", "which toy", choices=("a", "b"))
        width: int = option(2, "a width", kind=int)
        mask: str | None = None

        def check(self) -> None:
            if self.kind == "b" and self.width != 2:
                raise ValueError("width goes with kind='a' only")

    @keyword_entry(ToyOptions)
    def _toy_estimate(q, k, v, draws, options: ToyOptions) -> tuple:
        """A toy entry point: returns what it was given."""
        return q, k, v, draws, options

    return ToyOptions, _toy_estimate


@pytest.fixture
def toy():
    return _toy_family()


def _hand_written(q, k, v, draws, *, scale: float | None = None, kind: str = "a", width: int = 2,
                  mask: str | None = None) -> tuple:
    """The signature the decorated entry point must show."""


def test_entry_point_signature_is_the_hand_written_one(toy):
    _, _toy_estimate = toy
    got = inspect.signature(_toy_estimate)
    want = inspect.signature(_hand_written)
    assert [(p.name, p.kind, p.default, p.annotation) for p in got.parameters.values()] == [
        (p.name, p.kind, p.default, p.annotation) for p in want.parameters.values()
    ]
    assert _toy_estimate.__doc__ == "A toy entry point: returns what it was given."
    assert _toy_estimate.__name__ == "_toy_estimate"


def test_entry_point_builds_validated_options_from_keywords(toy):
    _ToyOptions, _toy_estimate = toy
    q, k, v, draws, options = _toy_estimate(1, 2, 3, "d", width=5, scale=0.5)
    assert (q, k, v, draws) == (1, 2, 3, "d")
    assert options == _ToyOptions(scale=0.5, kind="a", width=5, mask=None)
    # arrays by keyword too, as a caller of a hand-written function may pass them
    assert _toy_estimate(q=1, k=2, v=3, draws="d")[4] == _ToyOptions()


def test_on_options_is_the_implementation(toy):
    _ToyOptions, _toy_estimate = toy
    options = _ToyOptions(kind="b")
    assert _toy_estimate.on_options(1, 2, 3, "d", options)[4] is options


@pytest.mark.parametrize(
    ("args", "kwargs", "words"),
    [
        ((1, 2, 3, "d"), {"widht": 3}, "widht"),  # a misspelt keyword is named
        ((1, 2, 3, "d", 4), {}, "too many positional"),  # an option never goes positionally
        ((1, 2, 3), {}, "draws"),  # a missing array is named
    ],
)
def test_wrong_call_is_a_type_error_naming_the_entry_point(toy, args, kwargs, words):
    _, _toy_estimate = toy
    with pytest.raises(TypeError, match="_toy_estimate") as info:
        _toy_estimate(*args, **kwargs)
    assert words in str(info.value)


def test_family_rules_run_before_the_parameter_checks(toy):
    _ToyOptions, _toy_estimate = toy
    # kind="b" with width="x": the family's rule speaks first (its message names the paper's terms)
    with pytest.raises(ValueError, match="width goes with kind='a' only"):
        _ToyOptions(kind="b", width=3)
    with pytest.raises(ValueError, match="kind"):
        _toy_estimate(1, 2, 3, "d", kind="c")
    with pytest.raises(TypeError, match="width must be int"):
        _toy_estimate(1, 2, 3, "d", width=2.5)


def test_params_are_the_option_fields_in_order(toy):
    _ToyOptions, _ = toy
    assert _ToyOptions.params() == {
        "kind": Param("a", "which toy", choices=("a", "b")),
        "width": Param(2, "a width", kind=int),
    }
    assert _ToyOptions(width=4).as_keywords(scale=False) == {"kind": "a", "width": 4, "mask": None}
    assert _ToyOptions(scale=0.5).as_keywords() == {"scale": 0.5, "kind": "a", "width": 2, "mask": None}
    # a field made by option() has the Param's default as its own
    assert _ToyOptions().width == 2 and _ToyOptions().kind == "a"


def test_forms_of_a_module_are_those_it_defines_under_protocol_names():
    def estimate():
        return "e"

    def probabilities():
        return "p"

    module = types.SimpleNamespace(estimate=estimate, probabilities=probabilities, helper=lambda: None)
    forms = BatchedForms.of(module)
    assert forms.estimate is estimate
    assert forms.declared == ("probabilities",)
    assert forms.get("probabilities") is probabilities
    with pytest.raises(AttributeError):
        BatchedForms.of(types.SimpleNamespace(probabilities=probabilities))


def test_a_draw_written_on_options_leaves_out_scale_and_keeps_its_keyword_only_protocol(toy):
    ToyOptions, _ = toy

    @keyword_entry(ToyOptions, leave_out=("scale",))
    def draw(q_shape, k_shape, *, num_samples, replicates=1, rng=None, options: ToyOptions):
        return q_shape, k_shape, num_samples, replicates, rng, options

    def hand_written(q_shape, k_shape, *, num_samples, replicates=1, rng=None, kind: str = "a", width: int = 2,
                     mask: str | None = None):
        """The signature the decorated draw must show."""

    got, want = inspect.signature(draw), inspect.signature(hand_written)
    assert [(p.name, p.kind, p.default, p.annotation) for p in got.parameters.values()] == [
        (p.name, p.kind, p.default, p.annotation) for p in want.parameters.values()
    ]
    # replicates and rng not given: the function's own defaults
    assert draw((2, 3), (4, 3), num_samples=5, width=7) == ((2, 3), (4, 3), 5, 1, None, ToyOptions(width=7))
    with pytest.raises(TypeError, match="scale"):
        draw((2, 3), (4, 3), num_samples=5, scale=0.5)
    with pytest.raises(TypeError, match="num_samples"):
        draw((2, 3), (4, 3))


def test_numpy_scalars_are_the_python_numbers_they_equal(toy):
    import numpy as np

    ToyOptions, _ = toy
    options = ToyOptions(width=np.int64(3))
    assert options.width == 3 and type(options.width) is int
    with pytest.raises(TypeError, match="width must be int"):  # numpy's bool is no count, as Python's is not
        ToyOptions(width=np.bool_(True))
    with pytest.raises(TypeError, match="width must be int"):
        ToyOptions(width=np.float64(3.0))


def test_family_spec_wires_the_options_the_reference_and_the_torch_module(toy):
    from randattn.estimators.base import EstimatorSpec, family_spec

    ToyOptions, toy_estimate = toy
    reference = types.SimpleNamespace(estimate=toy_estimate)
    batched = types.SimpleNamespace(estimate=toy_estimate, probabilities=toy_estimate)

    def draw(q_shape, k_shape, *, num_samples, replicates=1, rng=None, **params):
        """A toy draw."""

    spec = family_spec(ToyOptions, draw, reference, batched, name="toy", summary="s", source="src", complexity="c")
    want = EstimatorSpec(name="toy", summary="s", source="src", complexity="c",
                         params={"kind": Param("a", "which toy", choices=("a", "b")),
                                 "width": Param(2, "a width", kind=int)},
                         draw=draw, reference=toy_estimate,
                         forms=BatchedForms(estimate=toy_estimate, probabilities=toy_estimate), stacked_draw=True)
    assert spec == want


def test_deterministic_spec_draws_nothing_and_checks_the_options_at_the_draw(toy):
    """A family without random variables: Draws({}, R) whatever S, rng and mask; the options are still checked."""
    from randattn.estimators.base import Draws, deterministic_spec

    ToyOptions, toy_estimate = toy
    module = types.SimpleNamespace(estimate=toy_estimate)
    spec = deterministic_spec(ToyOptions, module, module, name="toy", summary="s", source="src", complexity="c")
    assert (spec.needs_samples, spec.is_random({}), spec.is_random({"kind": "b"})) == (False, False, False)
    assert spec.draw((2, 5, 3), (2, 7, 3), replicates=4) == Draws({}, 4)
    assert spec.draw((5, 3), (5, 3), num_samples=9, rng=object(), mask="causal", kind="b") == Draws({}, 1)
    assert list(inspect.signature(spec.draw).parameters) == [
        "q_shape", "k_shape", "num_samples", "replicates", "rng", "kind", "width", "mask"]
    with pytest.raises(ValueError, match="width goes with kind='a' only"):
        spec.draw((5, 3), (5, 3), kind="b", width=3)
    assert spec.draw.__doc__ == ("Deterministic: no random variables, only the replicate count (``num_samples``, "
                                 "``rng`` and ``mask`` change nothing; the parameters are checked by ``ToyOptions``).")


def test_numpy_scalars_of_a_parameter_with_several_kinds():
    import numpy as np

    @dataclass(frozen=True, kw_only=True)
    class RealOptions(EstimatorOptions):
        beta: float = option(1.0, "a real coefficient", kind=(int, float))

    assert type(RealOptions(beta=np.int64(2)).beta) is int and type(RealOptions(beta=np.float32(0.5)).beta) is float
    assert RealOptions(beta=np.float32(0.5)).beta == 0.5
