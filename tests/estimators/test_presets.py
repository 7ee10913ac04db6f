"""Presets (issue #12 item 4): ``preset=official-code`` is exactly the parameters it stands for."""

from __future__ import annotations

import numpy as np
import pytest

import randattn
from randattn.estimators.registry import catalogue, parse_estimator
from randattn.testing import assert_close

#: the official code's conventions written out independently of randattn.estimators.presets
#: (HKUNLP/efficient-attention lara.py / eva.py / randomized_attention.py; see the module docstring there)
OFFICIAL = {
    "lara": {"proposal": "eq34", "weighting": "decoupled", "beta": 1.0, "alpha_clamp": 1e-8, "noise": "reference-code"},
    "eva": {"partition": "reference-code", "chunk_weight": "mean-key", "proposal_mean": "half", "noise": "reference-code"},
    "ra": {"variant": "unbiased", "noise": "reference-code"},
}


def _inputs():
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 13, 8)) * 1.5
    k = rng.standard_normal((2, 13, 8)) * 1.5
    v = rng.standard_normal((2, 13, 5))
    return q, k, v


@pytest.mark.parametrize("name", sorted(OFFICIAL))
@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_preset_equals_the_explicit_parameters_it_stands_for(name, backend):
    q, k, v = _inputs()
    kwargs = dict(num_samples=4, seed=11, replicates=2, backend=backend)
    if backend == "torch":
        import torch

        kwargs["dtype"] = torch.float64
    window = {"window": 4} if name == "eva" else {}
    by_preset = randattn.estimate(name, q, k, v, preset="official-code", **window, **kwargs)
    explicit = randattn.estimate(name, q, k, v, **OFFICIAL[name], **window, **kwargs)
    paper = randattn.estimate(name, q, k, v, **window, **kwargs)
    assert_close(by_preset, explicit, atol=0.0, rtol=0.0)  # same draws -> identical output
    # the preset changes something: the official code's estimator is not the paper's
    assert float(np.abs(np.asarray(by_preset) - np.asarray(paper)).max()) > 1e-6


@pytest.mark.parametrize("name", sorted(OFFICIAL))
def test_paper_preset_is_the_defaults(name):
    spec = randattn.get_spec(name)
    assert spec.resolve_params({"preset": "paper"}) == spec.resolve_params({})


def test_explicit_parameters_override_the_preset():
    spec = randattn.get_spec("lara")
    resolved = spec.resolve_params({"preset": "official-code", "beta": 2.0, "noise": "paper"})
    assert resolved["beta"] == 2.0 and resolved["noise"] == "paper"
    assert resolved["alpha_clamp"] == 1e-8  # the rest of the preset still applies
    assert "preset" not in resolved
    name, params = parse_estimator("lara:preset=official-code,beta=2")
    assert (name, params) == ("lara", {"preset": "official-code", "beta": 2.0})
    assert spec.resolve_params(params)["beta"] == 2.0


def test_eval_preset_is_deterministic():
    spec = randattn.get_spec("eva")
    assert not spec.is_random(spec.resolve_params({"preset": "official-code-eval"}))
    assert spec.is_random(spec.resolve_params({"preset": "official-code"}))


@pytest.mark.parametrize("text", ["lara:preset=offical-code", "rfa:preset=official-code"])
def test_unknown_preset_names_the_allowed_ones(text):
    with pytest.raises(ValueError, match=r"unknown preset .* allowed: paper"):
        parse_estimator(text)


def test_every_declared_preset_resolves_and_is_listed():
    records = {r["name"]: r for r in catalogue()}
    for name in randattn.list_estimators():
        spec = randattn.get_spec(name)
        assert records[name]["presets"]["paper"] == {}
        for preset in spec.preset_names():
            resolved = spec.resolve_params({"preset": preset})  # every value allowed by its Param
            assert records[name]["presets"][preset].items() <= resolved.items()
    assert set(records["lara"]["presets"]) == {"paper", "official-code", "official-code-eval"}
    assert set(records["ra"]["presets"]) == {"paper", "official-code"}


def test_estimators_json_lists_presets():
    import json

    from click.testing import CliRunner

    from randattn.cli import main

    result = CliRunner().invoke(main, ["estimators", "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    records = {r["name"]: r for r in json.loads(result.output)}
    assert records["lara"]["presets"]["official-code"]["alpha_clamp"] == 1e-8
    assert records["eva"]["presets"]["official-code"]["proposal_mean"] == "half"
    assert records["rfa"]["presets"] == {"paper": {}}
