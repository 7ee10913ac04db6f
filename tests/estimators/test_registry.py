"""The registry: built-ins and plugins found through the same entry-point group, clear errors that name a
broken plugin, and the broken one never breaking the others (in this process and in a real ``randattn``
process with plugins installed on its path)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import randattn
from randattn.estimators.registry import (
    BUILTIN_ENTRY_POINTS,
    EstimatorRegistry,
    register_estimator,
    unregister_estimator,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 has no tomllib; pytest itself depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


class FakeEntryPoint:
    def __init__(self, name, load, origin=None, dist="fakeplug 1.0"):
        self.name, self._load, self.origin, self.dist = name, load, origin or f"fake entry point {name}", dist

    def load(self):
        return self._load()


def _copy(name):
    return dataclasses.replace(randattn.get_spec("local"), name=name, display_name=name.title())


def test_pyproject_declares_the_builtins_as_entry_points_in_catalogue_order():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["randattn.estimators"]
    assert list(declared.items()) == list(BUILTIN_ENTRY_POINTS)
    assert randattn.list_estimators()[: len(BUILTIN_ENTRY_POINTS)] == [n for n, _ in BUILTIN_ENTRY_POINTS]


def test_a_broken_plugin_is_reported_by_name_and_the_others_still_work():
    def raises():
        raise ImportError("No module named 'missing_dependency'")

    registry = EstimatorRegistry(lambda: [
        FakeEntryPoint("good", lambda: _copy("good")),
        FakeEntryPoint("crashes", raises, "entry point 'crashes = crashplug:SPEC' of package crashplug 1.0"),
        FakeEntryPoint("invalid", lambda: dataclasses.replace(_copy("invalid"), cost="cheap")),
        FakeEntryPoint("misnamed", lambda: _copy("other-name")),
        FakeEntryPoint("good", lambda: _copy("good"), "entry point 'good = clash:SPEC' of package clash 2.0"),
        FakeEntryPoint("factory", lambda: (lambda: _copy("factory"))),
    ])
    assert registry.names() == ["factory"]  # two plugins claim "good": neither is used
    errors = {(e.name, e.origin): e.message for e in registry.errors()}
    assert "ImportError: No module named 'missing_dependency'" in errors[
        ("crashes", "entry point 'crashes = crashplug:SPEC' of package crashplug 1.0")]
    assert "cost of the defaults is 'cheap'" in errors[("invalid", "fake entry point invalid")]
    assert "its spec is named 'other-name'" in errors[("misnamed", "fake entry point misnamed")]
    assert errors[("good", "fake entry point good")] == (
        "the name 'good' is claimed by 2 installed plugins (fake entry point good; entry point 'good = clash:SPEC' "
        "of package clash 2.0), so none of them is used: uninstall all but one")
    with pytest.raises(ValueError, match="'good' is claimed by 2 installed plugins"):
        registry.get("good")
    with pytest.raises(ValueError, match="estimator plugin 'crashes' .*crashplug 1.0.* could not be registered"):
        registry.get("crashes")
    with pytest.raises(ValueError, match="unknown estimator 'nope'; known estimators: factory"):
        registry.get("nope")


def test_a_plugin_that_claims_a_builtin_name_is_left_out_and_three_claimants_are_all_named():
    local = randattn.get_spec("local")
    registry = EstimatorRegistry(lambda: [
        FakeEntryPoint("local", lambda: local, "randattn's own", dist="randattn 0.2.0"),
        FakeEntryPoint("local", lambda: _copy("local"), "impostor's"),
        *(FakeEntryPoint("twice", lambda: _copy("twice"), f"plugin {i}") for i in range(3)),
    ])
    assert registry.names() == ["local"] and registry.get("local") is local
    errors = {(e.name, e.origin): e.message for e in registry.errors()}
    assert errors[("local", "impostor's")] == "the name 'local' is taken by randattn's own"
    assert errors[("twice", "plugin 0")] == ("the name 'twice' is claimed by 3 installed plugins (plugin 0; plugin 1; "
                                             "plugin 2), so none of them is used: uninstall all but one")


def test_register_estimator_refuses_a_taken_name_and_an_invalid_spec():
    with pytest.raises(ValueError, match="'rfa' is already registered .*entry point 'rfa = randattn.estimators.rfa"):
        register_estimator(dataclasses.replace(randattn.get_spec("local"), name="rfa"))
    with pytest.raises(randattn.estimators.SpecError, match="masks must be a tuple holding None"):
        register_estimator(dataclasses.replace(_copy("x"), masks=("causal",)))
    spec = register_estimator(_copy("session-local"))
    try:
        assert randattn.get_spec("session-local") is spec and "session-local" in randattn.list_estimators()
        assert randattn.catalogue()[-1]["origin"] == "register_estimator()"
    finally:
        unregister_estimator("session-local")
    assert "session-local" not in randattn.list_estimators()


def test_a_plugin_parameter_named_like_an_argument_of_estimate_is_refused_with_the_list():
    """A parameter ``k`` would collide with the keys of ``randattn.estimate(name, q, k, v, ...)``: the spec is refused
    before it is registered, naming the parameter and every reserved name (written out here)."""
    from randattn.estimators.base import Param

    top_k = dataclasses.replace(_copy("top-k"), params={**_copy("top-k").params, "k": Param(4, "keys kept", kind=int)})
    listed = ("name, q, k, v, q_shape, k_shape, draws, num_samples, seed, replicates, rng, scale, mask, backend, "
              "dtype, device, preset")
    with pytest.raises(randattn.estimators.SpecError) as info:
        register_estimator(top_k)
    assert f"parameter name 'k' is reserved by randattn (the reserved names: {listed}); rename it" in str(info.value)
    assert "top-k" not in randattn.list_estimators()
    registry = EstimatorRegistry(lambda: [FakeEntryPoint("top-k", lambda: top_k)])
    assert registry.names() == [] and "parameter name 'k' is reserved" in registry.errors()[0].message
    # the conformance kit says so once, instead of every check failing on estimate()'s argument k
    from randattn.testing import check_estimator

    report = check_estimator(top_k, raise_on_failure=False)
    assert [r.check for r in report.failures] == ["spec is valid"]
    assert f"(the reserved names: {listed})" in report.failures[0].message
    assert {r.status for r in report.results[1:]} == {"skipped"}


@pytest.mark.parametrize("name", ["top-k", "2nd", "class", "top k"])
def test_a_parameter_name_that_is_no_keyword_argument_is_refused(name):
    from randattn.estimators.base import Param

    spec = dataclasses.replace(_copy("odd-name"), params={**_copy("odd-name").params, name: Param(4, "x", kind=int)})
    with pytest.raises(randattn.estimators.SpecError, match=f"parameter name {name!r} is not a Python identifier"):
        randattn.estimators.validate_spec(spec)


@pytest.mark.parametrize("answer", ["yes", 1, None])
def test_is_random_must_answer_true_or_false(answer):
    spec = dataclasses.replace(_copy("vague"), is_random=lambda params: answer)
    with pytest.raises(randattn.estimators.SpecError, match=f"is_random of the defaults is {answer!r}; it must be "
                                                            "True or False"):
        randattn.estimators.validate_spec(spec)


@pytest.mark.parametrize(("name", "hint"), [("topk", True), ("vattention", True), ("softmax", False)])
def test_an_unknown_parameter_of_an_estimator_that_takes_s_says_where_s_goes(name, hint):
    """``topk:k=3`` or ``budget=3``: S is not a parameter; an estimator that may take S says it is num_samples
    (``--samples`` on the command line, tests/cli); one that never takes S (softmax) does not. The error carries the
    facts (:class:`UnknownParameterError`) for a caller to word."""
    from randattn.estimators.base import UnknownParameterError
    from randattn.estimators.registry import parse_estimator

    q, k, v = np.ones((3, 4, 2))
    with pytest.raises(UnknownParameterError, match="unknown parameter") as api:
        randattn.estimate(name, q, k, v, num_samples=2, budget_keys=3)
    assert ("S, its sample size or key budget, is num_samples" in str(api.value)) == hint
    with pytest.raises(UnknownParameterError, match=r"unknown parameter\(s\) 'k'") as parsed:
        parse_estimator(f"{name}:k=3")
    assert (parsed.value.estimator, parsed.value.unknown, parsed.value.takes_samples) == (name, ("k",), hint)
    assert ("S, its sample size or key budget, is --samples" in parsed.value.naming("--samples")) == hint
    assert "S, its sample size" not in parsed.value.naming(None)
    # the hint that q, k and v are arrays given by position is Python's, not the command line's
    assert "input arrays" not in parsed.value.naming("--samples") and "input arrays" in str(parsed.value)


@pytest.mark.parametrize("answer", ["yes", 1, None, lambda params: "no"])
def test_needs_samples_must_be_true_or_false(answer):
    """A bool, or a function of the parameters that returns one (vAttention's: its adaptive budget takes no S)."""
    spec = dataclasses.replace(_copy("vague"), needs_samples=answer)
    shown = answer("") if callable(answer) else answer
    with pytest.raises(randattn.estimators.SpecError, match=f"needs_samples of the defaults is {shown!r}; it must be "
                                                            "True or False"):
        randattn.estimators.validate_spec(spec)
    fine = dataclasses.replace(_copy("vague"), needs_samples=lambda params: False)
    randattn.estimators.validate_spec(fine)
    assert not fine.needs_samples_of() and not fine.needs_samples_of({})


def test_the_reserved_names_cover_every_argument_of_estimate_and_draw_and_of_the_protocol_calls():
    """Any name ``randattn.estimate``/``draw`` take, or that ``draw``/``reference``/``batched`` get beside the
    parameters, is one a parameter would collide with."""
    import inspect

    from randattn.estimators.base import RESERVED_PARAMETER_NAMES

    taken = set()
    for function in (randattn.estimate, randattn.draw):
        taken |= {p.name for p in inspect.signature(function).parameters.values() if p.kind != p.VAR_KEYWORD}
    protocol = {"q", "k", "v", "draws", "scale", "mask", "q_shape", "k_shape", "num_samples", "replicates", "rng"}
    assert taken | protocol | {"preset"} <= set(RESERVED_PARAMETER_NAMES)


def test_a_repeated_estimator_parameter_is_refused():
    with pytest.raises(ValueError, match="parameter 'window' is given twice in 'local:window=4,window=8'"):
        randattn.estimators.registry.parse_estimator("local:window=4,window=8")


def test_a_mask_the_estimator_does_not_support_is_refused_by_name(rng):
    q = rng.normal(size=(4, 3))
    with pytest.raises(ValueError, match="estimator .lara. does not support mask=.causal. \\(it supports: none\\): its proposals are built from landmarks"):
        randattn.estimate("lara", q, q, q, num_samples=2, mask="causal")


# ------------------------------------------------------------------------------------------------ real processes
def _plugin_path(tmp_path: Path) -> Path:
    """A folder holding two installed plugins, as site-packages would: one good (a copy of local attention under
    another name and display name, found by its entry point) and one whose import raises."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "goodplug.py").write_text(textwrap.dedent("""
        import dataclasses
        from randattn.estimators.rfa import SPEC as _RFA
        SPEC = dataclasses.replace(_RFA, name="goodrfa", display_name="Good RFA (plugin)")
    """))
    (site / "brokenplug.py").write_text("raise RuntimeError('brokenplug needs a GPU driver')\n")
    for dist, line in (("goodplug", "goodrfa = goodplug:SPEC"), ("brokenplug", "broken = brokenplug:SPEC")):
        info = site / f"{dist}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(f"[randattn.estimators]\n{line}\n")
    return site


def _randattn(args, site: Path, cwd: Path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    return subprocess.run([sys.executable, "-c", "from randattn.cli import main; main()", *map(str, args)],
                          capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


@pytest.mark.slow  # over 6 s on the 2-core machine: in the slow target
def test_randattn_estimators_lists_plugins_and_names_the_broken_one(tmp_path):
    site = _plugin_path(tmp_path)
    done = _randattn(["estimators", "--json"], site, tmp_path)
    assert done.returncode == 0, done.stderr
    records = {r["name"]: r for r in json.loads(done.stdout)}
    assert {"rfa", "lara", "goodrfa"} <= set(records) and "broken" not in records
    assert records["goodrfa"]["origin"] == "entry point 'goodrfa = goodplug:SPEC' of package goodplug 0.1"
    assert "estimator plugin 'broken'" in done.stderr and "brokenplug needs a GPU driver" in done.stderr
    checked = _randattn(["check", "goodrfa", "--check", "reference == batched (float64)"], site, tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    broken = _randattn(["check", "broken"], site, tmp_path)
    assert broken.returncode == 2 and "brokenplug needs a GPU driver" in broken.stderr


@pytest.mark.slow  # three randattn processes (~12 s on the 2-core machine)
def test_a_name_two_installed_plugins_claim_is_refused_by_every_command(tmp_path):
    """Which of two plugins kept the name depended on the packages' names (the first by name was used, silently, by
    check and mse); now neither: each command that asks for the name exits 2 naming both packages."""
    site = _plugin_path(tmp_path)
    (site / "otherplug.py").write_text("import dataclasses\nfrom randattn.estimators.ra import SPEC as _RA\n"
                                       "SPEC = dataclasses.replace(_RA, name='goodrfa')\n")
    info = site / "aaaplug-0.1.dist-info"  # sorts before goodplug
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: aaaplug\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[randattn.estimators]\ngoodrfa = otherplug:SPEC\n")
    from randattn.activations import make_activations, save_activations

    rng = np.random.default_rng(0)
    acts = save_activations(make_activations({0: tuple(rng.normal(size=(1, 1, 8, 4)) for _ in range(3))},
                                             {"scale": 0.5}), tmp_path / "acts.safetensors")
    for args in (["check", "goodrfa"], ["mse", acts, "-e", "goodrfa", "--samples", "4", "--replicates", "2",
                                        "--out", tmp_path / "x.parquet"]):
        done = _randattn(args, site, tmp_path)
        assert done.returncode == 2, done.stdout + done.stderr
        assert "'goodrfa' is claimed by 2 installed plugins" in done.stderr
        assert "package aaaplug 0.1" in done.stderr and "package goodplug 0.1" in done.stderr
    assert not (tmp_path / "x.parquet").exists()


@pytest.mark.slow  # two Dask worker processes (~16 s); CI also runs it through examples/randattn-nystrom/run-example.sh
def test_a_plugin_estimator_gives_the_same_table_on_dask_workers_as_locally(tmp_path):
    import numpy as np

    pytest.importorskip("distributed")
    from randattn.activations import make_activations, save_activations

    site = _plugin_path(tmp_path)
    rng = np.random.default_rng(3)
    arrays = {layer: tuple(0.8 * rng.normal(size=(1, 2, 12, 4)) for _ in range(3)) for layer in (0, 1)}
    acts = save_activations(make_activations(arrays, {"scale": 0.5, "model": "synthetic"}), tmp_path / "acts.safetensors")
    tables = {}
    for where in ("local", "processes:2"):
        out = tmp_path / f"{where.replace(':', '')}.parquet"
        done = _randattn(["mse", acts, "-e", "goodrfa:coupling=orthogonal", "-e", "rfa", "--samples", "4,8",
                          "--replicates", "3", "--seed", "11", "--scheduler", where, "--threads", "1", "--out", out],
                         site, tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        tables[where] = pd.read_parquet(out).drop(columns="seconds")
    assert set(tables["local"].label) == {"goodrfa:coupling=orthogonal", "rfa"}
    pd.testing.assert_frame_equal(tables["local"], tables["processes:2"], check_exact=True)


def test_a_count_or_fraction_parameter_keeps_the_type_written():
    """vAttention's top_k is a count when an int and a fraction of the visible keys when a float: '1' is one key,
    '1.0' every key (the default 0.1 is a float, so converting by the default's type would read '1' as 100 %)."""
    parse = randattn.estimators.registry.parse_estimator
    assert parse("vattention:top_k=1")[1]["top_k"] == 1 and isinstance(parse("vattention:top_k=1")[1]["top_k"], int)
    assert isinstance(parse("vattention:top_k=1.0")[1]["top_k"], float)
    assert parse("vattention:top_k=0.25")[1]["top_k"] == 0.25


@pytest.mark.parametrize("text", ["rfa:", "rfa: ", "rfa:coupling=orthogonal,",
                                  "rfa:coupling=orthogonal,,feature_map=positive"])
def test_an_empty_estimator_option_is_refused_not_taken_for_the_defaults(text):
    """``-e rfa:`` ran RFA at its defaults, as did a trailing or doubled comma: a lost option ran unseen."""
    with pytest.raises(ValueError, match=r"has an empty option \(nothing after ':', between two commas or after"):
        randattn.estimators.registry.parse_estimator(text)
    assert randattn.estimators.registry.parse_estimator("rfa") == ("rfa", {})
    assert randattn.estimators.registry.parse_estimator(" rfa : coupling = orthogonal ") == (
        "rfa", {"coupling": "orthogonal"})
