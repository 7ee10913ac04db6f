"""`randattn verify`: the quick run passes, JSON parses, --only filters, bad usage exits 2, failures exit 1."""

from __future__ import annotations

import json

import numpy as np
from click.testing import CliRunner

from randattn.cli import main


def _invoke(*args):
    return CliRunner().invoke(main, ["verify", *args], catch_exceptions=False)


def test_quick_run_passes_and_prints_the_table():
    result = _invoke("--quick")
    assert result.exit_code == 0, result.output
    for text in ("lara.prop3.1.mixture", "eva.G.5.scatterbrain", "performer.thm2.orthogonal-mse", "Monte Carlo"):
        assert text in result.output
    assert "checks passed" in result.output


def test_json_output_parses_and_only_filters():
    result = _invoke("--quick", "--json", "--only", "eva.G.1.*")
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert [r["name"] for r in record["results"]] == ["eva.G.1.rfa", "eva.G.1.softmax-window", "eva.G.1.softmax-C=M"]
    assert record["passed"] is True
    first = record["results"][0]
    assert first["method"] == "exact identity" and first["source"] == "EVA app. G.1" and first["passed"] is True
    assert first["measured"] <= first["tolerance"]


def test_substring_pattern():
    result = _invoke("--quick", "--json", "--only", "oprf")
    assert result.exit_code == 0, result.output
    assert {r["name"] for r in json.loads(result.stdout)["results"]} == {"oprf.unbiased", "oprf.variance-closed-form", "oprf.optimal-a"}


def test_pattern_matching_nothing_is_a_usage_error():
    result = _invoke("--only", "no-such-check")
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert "--only 'no-such-check' matches no check" in said
    # the names it can match, where the help pointed to before (it lists none)
    from randattn.theory import registry

    assert f"the {len(registry())} checks are named family.result, e.g. 'lara.prop3.1.mixture'" in said
    assert "lara (10)" in said and "decode (8)" in said and "numerics (1)" in said and "--help" not in said


def test_unreadable_activation_file_is_a_usage_error(tmp_path):
    missing = tmp_path / "missing.safetensors"
    result = _invoke("--quick", "--activations", str(missing))
    assert result.exit_code == 2, result.output
    assert "cannot use --activations" in result.output
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    result = _invoke("--quick", "--activations", str(bad))
    assert result.exit_code == 2, result.output
    assert "cannot use --activations" in result.output and "bad.npz" in result.output


def test_activations_drive_the_data_dependent_checks(tmp_path):
    from randattn.activations.io import make_activations, save_activations

    rng = np.random.default_rng(0)
    arrays = {layer: tuple(rng.standard_normal((1, 2, 30, 8)) * s for s in (2.0, 2.0, 1.0)) for layer in (0, 3)}
    path = save_activations(make_activations(arrays, {"scale": 8**-0.5}), tmp_path / "acts.safetensors")
    result = _invoke("--quick", "--json", "--activations", str(path), "--only", "lara.*")
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert "16 of 30 evenly spaced tokens" in record["data"]
    inputs = {r["name"]: r["inputs"] for r in record["results"]}
    assert inputs["lara.prop3.1.mixture"] == "user data"
    assert inputs["lara.appF.mis-unbiased"].startswith("synthetic")


def test_a_failing_check_exits_1(monkeypatch):
    from randattn import theory

    def failing(rng, quick, data):
        """Always fails."""
        return theory.CheckResult("x.fail", 1.0, 0.0, False, "broken on purpose")

    monkeypatch.setattr(theory, "registry", lambda: (theory.Check("x.fail", "claim", "src", "closed form", failing),))
    result = _invoke("--quick")
    assert result.exit_code == 1, result.output
    assert "0 of 1 checks passed; failed: x.fail" in result.output


def test_json_of_a_check_that_errored_is_strict_json(monkeypatch):
    """A check that raises is reported with no measurement and no tolerance: ``null`` in the JSON, which every
    reader parses (``NaN`` is not JSON: ``parse_constant`` refuses it here, as JavaScript's parser does)."""
    from randattn.theory import _stability

    def broken(rng, n=12):
        raise RuntimeError("planted")

    monkeypatch.setattr(_stability, "_large_norm_inputs", broken)
    result = _invoke("--quick", "--json", "--only", "numerics.large-norm-stability")
    assert result.exit_code == 1, result.output

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    [record] = json.loads(result.stdout, parse_constant=refuse)["results"]
    assert record["passed"] is False and record["tolerance"] is None


def test_the_summary_bounds_the_false_alarms_of_the_checks_this_run_makes():
    """The bound is 2 sf(4.5) per Monte Carlo element tested: 24 declared by the lemma's check alone, 0.016 %;
    every check, 0.20 %; a run of no Monte Carlo check says so (it gave the whole registry's 0.20 % whatever ran)."""
    from scipy.stats import norm

    from randattn.theory import registry, select_checks

    [lemma] = select_checks(registry(), "eva.lemma3.partition")
    expected = lemma.max_tested * 2 * norm.sf(4.5)
    one = _invoke("--quick", "--only", "eva.lemma3.partition")
    assert f"family-wise false alarm <= {expected:.2%})" in one.output
    assert "no Monte Carlo check)" in _invoke("--quick", "--only", "numerics").output


def test_a_negative_seed_is_a_usage_error_not_failed_checks():
    """``--seed -1`` ran every check into numpy's refusal and printed them as errors, exit 1 ("a check failed");
    mse and demo refuse it with exit 2."""
    result = _invoke("--quick", "--seed", "-1", "--only", "snis*")
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--seed': -1 is not in the range x>=0" in " ".join(result.output.split())
    assert "error: ValueError" not in result.output
