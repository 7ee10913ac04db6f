"""``randattn check`` on something that is not an estimator spec: exit 2, saying what it got and what it wants,
before any check runs. The ``name:param=value`` form of ``randattn mse -e`` is answered with the ``-p`` options
that give the same configuration."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from randattn.cli import main

WANTS = ("randattn check wants a registered estimator name, or 'module:OBJECT' where OBJECT is an EstimatorSpec or "
         "a function of no arguments that returns one")


def _check(*args: str):
    return CliRunner().invoke(main, ["check", *args])


@pytest.mark.parametrize(
    ("target", "got"),
    [
        ("os.path:join", "a function, join, that needs arguments (a)"),
        ("os:getcwd", "a function, getcwd, that returned a str, not an EstimatorSpec"),
        ("os.path:sep", "a str, not an EstimatorSpec"),
        ("os:path", "a module, not an EstimatorSpec"),
        ("randattn.estimators.base:EstimatorSpec", "a class (EstimatorSpec), not an EstimatorSpec instance"),
    ],
)
def test_check_refuses_an_object_that_is_no_spec(target, got):
    result = _check(target)
    assert result.exit_code == 2, result.output
    assert result.output == f"error: {target!r} is {got}; {WANTS}\n"


@pytest.mark.parametrize(
    ("target", "options"),
    [
        ("rfa:coupling=orthogonal", "-p coupling=orthogonal"),
        ("rfa:coupling=orthogonal,feature_map=hyperbolic", "-p coupling=orthogonal -p feature_map=hyperbolic"),
        ("rfa:coupling", "-p coupling=VALUE"),
    ],
)
def test_check_points_the_mse_estimator_syntax_to_its_p_options(target, options):
    result = _check(target)
    assert result.exit_code == 2, result.output
    assert result.output == (f"error: {target!r} is the estimator 'rfa' with parameters, as randattn mse -e writes "
                             f"it; randattn check takes the parameters apart: randattn check rfa {options}\n")


def test_the_suggested_p_options_are_accepted():
    result = _check("rfa", "-p", "coupling=orthogonal", "--check", "reference == batched (float64)")
    assert result.exit_code == 0, result.output
    assert "all checks passed" in result.output


def test_load_spec_error_carries_the_facts():
    from randattn.testing import SpecTargetError, load_spec

    with pytest.raises(SpecTargetError) as caught:
        load_spec("rfa:coupling=orthogonal")
    assert (caught.value.estimator, caught.value.params) == ("rfa", ("coupling=orthogonal",))
    assert str(caught.value) == ("'rfa:coupling=orthogonal' is the estimator 'rfa' with parameters "
                                 "coupling=orthogonal; expected the estimator's name alone, with its parameters "
                                 "given apart")
    with pytest.raises(SpecTargetError) as caught:
        load_spec("os.path:join")
    assert caught.value.estimator is None and caught.value.got == "a function, join, that needs arguments (a)"


@pytest.mark.parametrize(("target", "param", "said"), [
    ("lara", "beta=abc", "beta must be int/float, got str 'abc'"),
    ("eva", "window=2.5", "window must be int, got str '2.5'"),
    ("randattn.estimators.eva:SPEC", "window=abc", "window must be int"),
])
def test_a_parameter_of_the_wrong_type_is_bad_usage_named(target, param, said):
    """A word where a number goes is refused like a value out of range: exit 2 and the parameter's own message,
    not a traceback."""
    result = CliRunner().invoke(main, ["check", target, "-p", param])
    assert result.exit_code == 2, result.output
    assert said in result.output and "Traceback" not in result.output


@pytest.mark.parametrize(("target", "param", "said"), [
    ("streaming", "sinks=-1", "estimator 'streaming' with sinks=-1: sinks must be >= 0, got -1"),
    ("vattention", "epsilon=2", "estimator 'vattention' with epsilon=2: epsilon must be in (0, 1)"),
    ("randattn.estimators.streaming:SPEC", "sinks=-1", "sinks must be >= 0, got -1"),
])
def test_a_value_the_estimators_rules_refuse_is_bad_usage_not_failed_checks(target, param, said):
    """``sinks=-1`` passes the parameter's type but not streaming's own rule: every check failed on it (exit 1,
    "18 failed"), where ``randattn mse -e streaming:sinks=-1`` refuses it (exit 2). Now check refuses it too,
    with the estimator's message, before any check runs."""
    result = CliRunner().invoke(main, ["check", target, "-p", param])
    assert result.exit_code == 2, result.output
    assert said in " ".join(result.output.split()) and "failed" not in result.output


def test_an_unknown_option_says_no_command_line_option_for_s():
    """check has no --samples (each check picks its own S): an unknown option of an estimator that takes S is
    refused without the hint mse gives."""
    result = _check("topk", "-p", "sink=1")
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert "unknown parameter(s) 'sink' for estimator 'topk'; allowed: preset" in text and "--samples" not in text


def test_a_module_not_on_the_path_is_refused_with_the_way_to_put_it_there(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = _check("not_a_module_here:SPEC")
    assert result.exit_code == 2
    assert ("No module named 'not_a_module_here' (the randattn command does not search the current folder: run it "
            "there with PYTHONPATH=., or install the module's package)") in " ".join(result.output.split())


def test_an_object_of_a_type_that_starts_with_a_vowel_reads_as_an():
    result = _check("os:EX_OK")
    assert result.exit_code == 2 and "'os:EX_OK' is an int, not an EstimatorSpec" in " ".join(result.output.split())


def test_a_configuration_refusal_is_said_only_where_the_defaults_are_taken():
    """Where the draw refuses the defaults too, the estimator is at fault and the checks must say how: no refusal."""
    import dataclasses

    import randattn
    from randattn.testing.checks import configuration_refusal

    streaming = randattn.get_spec("streaming")
    assert configuration_refusal(streaming, {"sinks": -1}) == "sinks must be >= 0, got -1"
    assert configuration_refusal(streaming, {"sinks": 2}) is None

    def refuses(*args, **kwargs):
        raise ValueError("this draw refuses everything")

    assert configuration_refusal(dataclasses.replace(streaming, draw=refuses), {"sinks": -1}) is None


def test_check_prints_the_note_of_a_configuration_exact_on_every_check_input():
    import json

    result = _check("vattention", "--check", "spec is valid")
    assert result.exit_code == 0, result.output
    assert "note: on the checks' inputs (64 keys at most) this configuration returns exact softmax attention" in (
        " ".join(result.output.split()))
    small = _check("vattention", "-p", "sinks=1", "-p", "local=2", "-p", "top_k=2", "--check", "spec is valid",
                   "--json")
    assert small.exit_code == 0 and json.loads(small.output)["notes"] == []


@pytest.mark.parametrize("param", ["", "coupling", "coupling=orthogonal,", "coupling=orthogonal,feature_map=positive"])
def test_each_param_is_answered_in_its_own_words(param):
    """``-p`` items are joined into ``-e``'s ``name:a=1,b=2`` for the registry: an empty or comma-holding one was
    answered in ``-e``'s words ("estimator 'rfa:' has an empty option"), for a command the user never typed."""
    result = _check("rfa", "-p", param, "--check", "shapes and dtypes")
    assert result.exit_code == 2, result.output
    assert result.output == (f"error: --param {param!r}: expected NAME=VALUE with NAME one of feature_map, coupling "
                             "(one -p each)\n")
