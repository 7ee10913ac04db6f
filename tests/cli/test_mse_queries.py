"""``randattn mse --queries`` and ``--epsilon`` end to end: the selection recorded in the table and its metadata, the
keys-read and promise columns, a broken promise said per head (terminal and --json), and every refusal (exit 2)
before any work."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from randattn.activations import make_activations, save_activations
from randattn.analysis.queries import query_rows
from randattn.cli import main
from randattn.estimators.registry import register_estimator, unregister_estimator


def _helper():
    """The sweep tests' test estimator (tests/analysis/_sampled_keys.py), loaded from its file: no sys.path change."""
    location = importlib.util.spec_from_file_location(
        "_sampled_keys", Path(__file__).resolve().parents[1] / "analysis" / "_sampled_keys.py")
    module = importlib.util.module_from_spec(location)
    location.loader.exec_module(module)
    return module


_SAMPLED_KEYS = _helper()
NAME, SPEC = _SAMPLED_KEYS.NAME, _SAMPLED_KEYS.SPEC

TOKENS = 8
PROMISING = f"{NAME}:eps=0.01,delta=0.001"  # sampled keys miss the truth by more than 1% nearly always: broken


@pytest.fixture(scope="module")
def acts_file(tmp_path_factory):
    rng = np.random.default_rng(5)
    arrays = {0: tuple(1.5 * rng.normal(size=(1, 2, TOKENS, 4)) for _ in range(3))}
    meta = {"scale": 0.5, "model": "synthetic", "layout": "sequence"}
    return save_activations(make_activations(arrays, meta), tmp_path_factory.mktemp("q") / "acts.safetensors")


@pytest.fixture(scope="module", autouse=True)
def sampled_keys():
    register_estimator(SPEC)
    yield
    unregister_estimator(NAME)


def _invoke(*args):
    return CliRunner().invoke(main, ["mse", *map(str, args)], catch_exceptions=False)


def _words(result) -> str:
    return " ".join(result.output.split())


def test_last_k_under_the_causal_mask_with_a_promise(acts_file, tmp_path, monkeypatch):
    from randattn.cli._common import out_console

    monkeypatch.setattr(out_console, "width", 300)  # each cell of the tables on one line, as the assertions read them
    out = tmp_path / "decode.parquet"
    result = _invoke(acts_file, "--mask", "causal", "--queries", "last:3", "-e", PROMISING, "-e", "softmax",
                     "--samples", "3", "--replicates", "4", "--epsilon", "0.2", "--out", out, "--threads", "1")
    assert result.exit_code == 0, result.output
    table = pd.read_parquet(out)
    assert set(table["queries"]) == {"last:3"} and set(table["tokens"]) == {TOKENS}
    promising, exact = table[table.estimator == NAME], table[table.estimator == "softmax"]
    assert (promising["epsilon"] == 0.01).all() and (promising["delta"] == 0.001).all()
    assert promising["promise_broken"].all() and (promising["keys_used"] > 0).all()
    assert (promising["trials"] == 12).all() and (promising["violations"] >= 10).all()  # R x K, and nearly all
    assert (exact["epsilon"] == 0.2).all() and (exact["violation_rate"] == 0).all() and exact["keys_used"].isna().all()
    meta = json.loads(out.with_name("decode.parquet.meta.json").read_text())
    assert meta["queries"] == {"selection": "last:3", "of": TOKENS, "rows": [5, 6, 7], "sample_seed": None}
    assert meta["epsilon"] == 0.2 and meta["config_identity"]["queries"] == "last:3"
    text = _words(result)
    assert "on the last 3 queries" in text and "keys read and relative error" in text
    assert "measuring the last 3 queries of each head" in text
    assert text.count("promise broken:") == 2  # one line per head
    # 2.5 % of the heads checked; both heads' tails at delta (at least 10 of 12 trials violated: P <= 7e-29)
    # are far below Holm's 2.5 % / 2
    assert "broken on 2 of 2 heads (<= 0.05 expected by chance; family-wise: 2)" in text
    assert f"promise broken: {PROMISING} S=3 layer 0 head 1 sequence" in text
    assert text.count("; flagged family-wise too") == 2


def test_json_names_the_heads_whose_promise_breaks(acts_file):
    result = _invoke(acts_file, "--mask", "causal", "--queries", "last:3", "-e", PROMISING, "-e", "softmax",
                     "--samples", "3", "--replicates", "4", "--json", "--threads", "1")
    assert result.exit_code == 0, result.output
    records = {r["label"]: r for r in json.loads(result.stdout)}
    broken = records[PROMISING]["broken_promises"]
    assert [(b["layer"], b["head"]) for b in broken] == [(0, 0), (0, 1)]
    assert all(b["violation_lo"] > b["delta"] == 0.001 and b["queries"] == "last:3" for b in broken)
    assert all(b["familywise"] is True for b in broken)
    assert records[PROMISING]["promises_broken"] == 2 and records[PROMISING]["heads"] == 2
    assert records[PROMISING]["promises_broken_familywise"] == 2
    assert {r["queries"] for r in records.values()} == {"last:3"}  # the run's selection, on every record
    # no promise: 0 heads flagged, as promises_broken; an integer either way
    assert records["softmax"]["promises_broken_familywise"] == 0
    assert all(type(r["promises_broken_familywise"]) is int for r in records.values())
    assert records["softmax"]["broken_promises"] == [] and records["softmax"]["keys_used"] is None


def test_json_gives_a_configuration_without_s_its_broken_promise_at_every_s(acts_file):
    """A configuration that takes no S (as adaptive vAttention) is measured once and its record repeated at each S:
    each record lists the broken head, once, with S None."""
    from dataclasses import replace

    def draw_without_s(q_shape, k_shape, *, num_samples=None, **kwargs):
        return SPEC.draw(q_shape, k_shape, num_samples=2, **kwargs)  # its own sample size, whatever S says

    register_estimator(replace(SPEC, name="own-size", draw=draw_without_s, needs_samples=False))
    try:
        result = _invoke(acts_file, "--mask", "causal", "--queries", "last:3", "-e", "own-size:eps=0.01,delta=0.001",
                         "--samples", "3,4", "--replicates", "4", "--json", "--threads", "1")
    finally:
        unregister_estimator("own-size")
    assert result.exit_code == 0, result.output
    records = [r for r in json.loads(result.stdout) if r["label"].startswith("own-size")]
    assert [r["num_samples"] for r in records] == [3, 4]
    for record in records:
        assert record["promises_broken"] == 2
        assert [(b["head"], b["num_samples"]) for b in record["broken_promises"]] == [(0, None), (1, None)]


def test_a_promise_on_the_denominator_is_named_where_it_is_reported(acts_file, tmp_path):
    """The terminal's summary and broken-promise lines, the --json records and the table say that the violation
    rate counts the denominator's error for a promise on it (and stay as they were for a promise on the output)."""
    denominator = f"{NAME}:eps=0.01,delta=0.001,on=denominator"
    out = tmp_path / "denominator.csv"
    result = _invoke(acts_file, "--mask", "causal", "--queries", "last:3", "-e", denominator, "-e", PROMISING,
                     "--samples", "3", "--replicates", "4", "--out", out, "--threads", "1")
    assert result.exit_code == 0, result.output
    table = pd.read_csv(out)
    assert list(table.groupby("label", sort=False)["violation_of"].unique().map(list)) == [["denominator"],
                                                                                          ["output"]]
    text = _words(result)
    assert "at eps = 0.01 (denominator)" in text and text.count("(denominator)") == 1
    assert f"promise broken: {denominator} S=3 layer 0 head 0 sequence image0: P(denominator err > 0.01) =" in text
    assert f"promise broken: {PROMISING} S=3 layer 0 head 0 sequence image0: P(err > 0.01) =" in text
    records = {r["label"]: r for r in json.loads(_invoke(acts_file, "--mask", "causal", "--queries", "last:3", "-e",
                                                         denominator, "--samples", "3", "--replicates", "4",
                                                         "--json", "--threads", "1").stdout)}
    assert records[denominator]["violation_of"] == "denominator"
    assert {b["violation_of"] for b in records[denominator]["broken_promises"]} == {"denominator"}


def test_a_sample_is_reproducible_from_the_seed(acts_file, tmp_path):
    out = tmp_path / "sample.csv"
    result = _invoke(acts_file, "--queries", "sample:3", "-e", "softmax", "--samples", "2", "--seed", "5",
                     "--out", out)
    assert result.exit_code == 0, result.output
    meta = json.loads(out.with_name("sample.csv.meta.json").read_text())
    assert meta["queries"]["rows"] == list(query_rows("sample:3", TOKENS, 5)) and meta["queries"]["sample_seed"] == 5
    assert set(pd.read_csv(out)["queries"]) == {"sample:3"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--queries", "last:0"], "--queries 'last:0': use all, last:K or sample:K with K a positive integer"),
        (["--queries", "last:x"], "--queries 'last:x': use all, last:K or sample:K"),
        (["--queries", "foo"], "--queries 'foo': use all, last:K or sample:K"),
        (["--queries", "last:9"], "--queries last:9: K = 9 is more than the 8 queries per head of"),
        (["--queries", "sample:3", "--mask", "causal"],
         "queries='sample:3' cannot be measured on layer 0 under mask 'causal'"),
        (["--queries", "last:3", "-e", "local"],
         "estimator 'local' cannot be measured on 3 of 8 queries without a mask (layer 0)"),
        (["--epsilon", "0"], "--epsilon 0: must be in (0, 1)"),
        (["--epsilon", "1"], "--epsilon 1: must be in (0, 1)"),
        (["--epsilon", "1.5"], "--epsilon 1.5: must be in (0, 1)"),
    ],
    ids=["zero", "not-a-number", "unknown", "more-than-N", "sample-causal", "layout-subset", "eps-0", "eps-1",
         "eps-1.5"],
)
def test_refused_before_any_work(acts_file, tmp_path, args, message):
    out = tmp_path / "r.parquet"
    result = _invoke(acts_file, "--samples", "2", "--out", out, *args)
    assert result.exit_code == 2, result.output
    assert message in _words(result)
    assert not out.exists() and not out.with_name("r.parquet.parts").exists()


def test_epsilon_says_which_estimators_it_does_not_reach(acts_file):
    """``--epsilon 0.2`` beside estimators that promise their own (epsilon, delta): the run says it does not reach
    them and names their own epsilon; beside none it says nothing. The table's rows carry each one's own epsilon."""
    def note(*estimators):
        args = [a for e in estimators for a in ("-e", e)]
        result = _invoke(acts_file, "--mask", "causal", "--queries", "last:3", *args, "--samples", "3",
                         "--replicates", "2", "--epsilon", "0.2", "--dry-run", "--threads", "1")
        assert result.exit_code == 0, result.output
        return [line for line in result.output.splitlines() if line.startswith("--epsilon")]

    rule = ("an estimator that promises (epsilon, delta) is checked at its own epsilon, on the quantity its promise "
            "bounds")
    assert note(PROMISING, "topk") == [f"--epsilon 0.2 applies to the estimators without a promise of their own: "
                                       f"{rule} ({PROMISING}: 0.01)"]
    assert note(PROMISING) == [f"--epsilon 0.2 applies to none of the estimators: {rule} ({PROMISING}: 0.01)"]
    assert note("topk") == []


def test_the_rows_written_count_the_measurements_of_a_configuration_without_s_once(acts_file, tmp_path):
    """Softmax takes no S: at S = 2 and 3 its one measurement per head is written twice. The run said "wrote 8
    rows" after planning 6 cells; it says how many measurements the rows hold, and one row is "1 row"."""
    result = _invoke(acts_file, "--mask", "causal", "-e", "softmax", "-e", "topk", "--samples", "2,3",
                     "--out", tmp_path / "t.csv", "--threads", "1")
    assert result.exit_code == 0, result.output
    assert "plan: 6 cells" in _words(result)
    assert "wrote 8 rows (6 measurements: a configuration without S repeats its row at each S) to" in _words(result)
    single = _invoke(acts_file, "--mask", "causal", "-e", "topk", "--samples", "2", "--heads", "0",
                     "--out", tmp_path / "one.csv", "--threads", "1")
    assert "wrote 1 row to" in _words(single)


@pytest.mark.parametrize(("estimator", "causal"), [("local", True), ("lara", False), ("rfa:feature_map=oprf", False)])
def test_a_subset_refused_without_a_mask_offers_the_causal_form_only_where_there_is_one(acts_file, estimator, causal):
    """LARA and RFA's OPRF have no causal form: the advice to measure them "under --mask causal with last:K" sent
    the user to a second refusal. OPRF is refused at all: its parameters are fitted to the queries present."""
    result = _invoke(acts_file, "--samples", "2", "--queries", "last:3", "-e", estimator, "--dry-run")
    assert result.exit_code == 2, result.output
    words = _words(result)
    assert f"estimator '{estimator}' cannot be measured on 3 of 8 queries without a mask (layer 0)" in words
    assert "so a subset of queries would measure another estimator; measure it with --queries all" in words
    assert ("or under --mask causal with last:K" in words) is causal
