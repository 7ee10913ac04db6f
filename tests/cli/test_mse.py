"""``randattn mse`` end to end on a small synthetic activation file."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from click.testing import CliRunner

from randattn.activations import make_activations, save_activations
from randattn.cli import main


@pytest.fixture
def acts_file(tmp_path, rng):
    arrays = {layer: tuple(0.8 * rng.normal(size=(2, 2, 8, 4)) for _ in range(3)) for layer in (0, 1)}
    return save_activations(make_activations(arrays, {"scale": 0.5, "model": "synthetic"}), tmp_path / "acts.safetensors")


def _invoke(*args):
    return CliRunner().invoke(main, ["mse", *map(str, args)], catch_exceptions=False)


def test_mse_writes_table_metadata_and_summary(acts_file, tmp_path):
    out = tmp_path / "res.parquet"
    result = _invoke(acts_file, "--estimators", "rfa;rfa:coupling=orthogonal", "-e", "softmax", "--samples", "4,8",
                     "--replicates", "3", "--seed", "7", "--out", out, "--no-diagnostics")
    assert result.exit_code == 0, result.output
    table = pd.read_parquet(out)
    assert len(table) == 2 * 2 * 2 * 3 * 2 and set(table.label) == {"rfa", "rfa:coupling=orthogonal", "softmax"}
    meta = json.loads((tmp_path / "res.parquet.meta.json").read_text())
    assert meta["seed"] == 7 and meta["command_line"].startswith("randattn") and "randattn_version" in meta
    assert meta["config"]["estimators"] == ["rfa", "rfa:coupling=orthogonal", "softmax"]
    assert not (tmp_path / "res.parquet.parts").exists()
    assert "attention MSE" in result.output


def test_mse_json_summary_on_stdout(acts_file):
    result = _invoke(acts_file, "--estimators", "rfa", "--samples", "4", "--replicates", "3", "--layers", "1",
                     "--no-diagnostics", "--no-probabilities", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert [(r["label"], r["num_samples"]) for r in summary] == [("rfa", 4)]
    assert summary[0]["mse_lo"] <= summary[0]["mse"] <= summary[0]["mse_hi"]


def test_mse_resume_continues_with_same_out(acts_file, tmp_path):
    out = tmp_path / "res.csv"
    parts = tmp_path / "res.csv.parts"
    parts.mkdir()
    (parts / "manifest.json").write_text("{}")  # a run stopped before its first unit: it must not block
    result = _invoke(acts_file, "--estimators", "rfa", "--samples", "4", "--replicates", "3", "--out", out,
                     "--no-diagnostics")
    assert result.exit_code == 0, result.output
    out.unlink()
    out.with_name(out.name + ".meta.json").unlink()  # left alone, a table's metadata without it refuses a run
    parts.mkdir()
    (parts / "part-L0-0123456789abcdef.parquet").write_bytes(b"")
    result = _invoke(acts_file, "--estimators", "rfa", "--samples", "4", "--replicates", "3", "--out", out)
    assert result.exit_code == 2
    assert "holds an unfinished run; add --resume to continue it, or --force" in result.output
    import shutil

    shutil.rmtree(parts)
    result = _invoke(acts_file, "--estimators", "rfa", "--samples", "4", "--replicates", "3", "--out", out,
                     "--no-diagnostics", "--resume")
    assert result.exit_code == 0, result.output
    assert len(pd.read_csv(out)) == 8


@pytest.mark.parametrize(
    ("make_args", "message"),
    [
        (lambda f, t: [t / "missing.safetensors"], "cannot read activations: activation file not found"),
        (lambda f, t: [_corrupt(t)], "cannot read activations:"),
        (lambda f, t: [f, "--estimators", "rfa;nope"], "unknown estimator 'nope'; known estimators: softmax, rfa"),
        (lambda f, t: [f, "-e", "rfa:bogus=1"], "unknown parameter(s) 'bogus' for estimator 'rfa'"),
        (lambda f, t: [f, "-e", "topk:k=4"], "'k' for estimator 'topk'; allowed: preset; S, its sample size or key "
                                             "budget, is --samples"),
        (lambda f, t: [f, "-e", "rfa:coupling=weird"], "coupling='weird' is not allowed"),
        (lambda f, t: [f, "--samples", "4,x"], "--samples: cannot read 'x'"),
        (lambda f, t: [f, "--layers", "7"], "layers [7] not in the activations; available: [0, 1]"),
        (lambda f, t: [f, "--max-memory", "lots"], "--max-memory: cannot read 'lots'"),
        (lambda f, t: [f, "--resume"], "--resume needs --out"),
        (lambda f, t: [f, "--replicates", "1"], "--replicates 1: random estimators need at least 2 replicates"),
        (lambda f, t: [f, "--out", t / "r.xlsx"], "unknown suffix '.xlsx'"),
    ],
    ids=["missing-file", "corrupt-file", "unknown-estimator", "unknown-param", "s-as-param", "bad-value",
         "bad-samples", "bad-layer", "bad-memory", "resume-without-out", "one-replicate", "bad-out"],
)
def test_mse_user_errors_exit_2(acts_file, tmp_path, make_args, message):
    result = _invoke(*make_args(acts_file, tmp_path))
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())


def _corrupt(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(b"not a safetensors file")
    return path
