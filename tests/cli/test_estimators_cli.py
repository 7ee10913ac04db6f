"""`randattn estimators`: the catalogue as a table and as JSON."""

from __future__ import annotations

import json

from click.testing import CliRunner

from randattn.cli import main


def test_estimators_table_lists_the_catalogue():
    result = CliRunner().invoke(main, ["estimators"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    for name in ("softmax", "rfa", "ra", "trigonometric", "orthogonal", "simplex", "oprf", "reference-code"):
        assert name in result.output


def test_estimators_json_is_machine_readable():
    result = CliRunner().invoke(main, ["estimators", "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    records = json.loads(result.output)
    names = [r["name"] for r in records]
    assert names[:3] == ["softmax", "rfa", "ra"]
    rfa = records[1]
    assert rfa["parameters"]["coupling"]["choices"] == ["iid", "orthogonal", "simplex", "orthogonal-plain-qr"]
    assert rfa["complexity"].startswith("O(")


def test_the_json_catalogue_gives_every_declared_fact():
    """README: the catalogue prints every declared fact of each estimator's defaults, each read from its spec."""
    from randattn.estimators.registry import get_spec

    records = {r["name"]: r for r in json.loads(CliRunner().invoke(main, ["estimators", "--json"]).output)}
    vattention, topk, rfa = records["vattention"], records["topk"], records["rfa"]
    assert vattention["promise"] == {"epsilon": 0.05, "delta": 0.05, "on": "denominator"} and rfa["promise"] is None
    assert vattention["keys_used"] and vattention["log_denominator"] and not rfa["keys_used"]
    assert (topk["selection"], rfa["selection"]) == ("discrete", "continuous")
    assert vattention["query_placement"] == "last-n-of-m" and topk["normalized"] is True
    spec = get_spec("vattention")
    assert vattention["exact_limits"] == [limit.description for limit in spec.exact_limits]
    assert vattention["forms"] == list(spec.forms.declared) and vattention["stacked_draw"] is spec.stacked_draw


def test_unknown_command_is_a_usage_error():
    result = CliRunner().invoke(main, ["frobnicate"])
    assert result.exit_code == 2
    assert "No such command 'frobnicate'" in result.output


def test_estimators_table_shows_each_parameters_description_default_and_choices():
    from randattn.estimators.registry import get_spec

    result = CliRunner().invoke(main, ["estimators"], catch_exceptions=False, terminal_width=400)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.replace("│", " ").split())
    lara = get_spec("lara").params
    for pname in ("weighting", "beta", "alpha_clamp"):
        assert f"{pname} (default {lara[pname].default!r}" in text
        assert " ".join(lara[pname].doc.split()[:6]) in text  # the description, as --json has it
    assert "choices decoupled | balance | coupled | constant" in text
