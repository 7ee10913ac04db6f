"""``randattn.workflows.demo``: the ViT demo's capture -> sweep -> report chain, called from Python (its command
line, ``randattn demo``, is tested in tests/cli/test_plot_report_demo.py)."""

from __future__ import annotations

import pytest


@pytest.mark.slow  # over 6 s on the 2-core machine: in the slow target
def test_run_demo_with_fake_capture_and_real_sweep(tmp_path):
    """The pipeline without the ONNX model: synthetic activations through the real sweep, table, figure, report."""
    import numpy as np

    from randattn.activations import make_activations
    from randattn.workflows.demo import DemoConfig, run_demo

    def fake_capture(images, size, layers, model):
        rng = np.random.default_rng(size)
        n = (size // 14) ** 2 + 1
        arrays = {layer: tuple(rng.standard_normal((len(images), 2, n, 8)).astype(np.float32) for _ in "qkv")
                  for layer in layers}
        return make_activations(arrays, {"scale": 8 ** -0.5, "model": "fake", "images": list(images)})

    config = DemoConfig(images=("a", "b"), sizes=(28, 42), layers=(0, 1), samples=(2, 4), replicates=3,
                        estimators=("softmax", "rfa"), single_sample=("ra",), diagnostics=False)
    steps = []
    result = run_demo(config, tmp_path, command="randattn demo (test)", capture=fake_capture,
                      load_model=lambda: None, progress=steps.append)
    table = result.table
    assert sorted(table["tokens"].unique()) == [5, 10]
    assert set(table["label"]) == {"softmax", "rfa", "ra"}
    assert set(table.loc[table["label"] == "ra", "num_samples"]) == {1}
    assert len(table) == 2 * 2 * 2 * 2 * (2 + 2 + 1)  # sizes x images x layers x heads x (softmax, rfa at 2 S; ra)
    assert {"table", "metadata", "figure.png", "figure.svg", "report"} <= set(result.files)
    assert all(path.exists() for path in result.files.values())
    page = result.files["report"].read_text(encoding="utf-8")
    assert "randattn demo (test)" in page
    # readable names with the exact spec as tooltip; diagnostics say why they are missing
    assert '<th title="rfa">Performer (FAVOR+, iid)</th>' in page and ">RA (unbiased)<" in page
    assert "k-hat not computed: diagnostics were turned off for this run" in page
    assert {step.name for step in steps} >= {"loading model", "capture", "sweep N=5", "sweep N=10", "report"}
    assert set(result.seconds) == {"capture", "sweep", "report", "total"}
    # the float64 reference check is recorded as randattn mse records it: the worst of the checked units' rows
    import json

    check = json.loads(result.files["metadata"].read_text())["reference_check"]
    checked = table[np.isfinite(table["ref_max_abs_dev"])]
    # softmax takes no S: its one checked measurement stands in the table at each S, and is one unit
    softmax = checked["label"] == "softmax"
    units = int((~softmax).sum()) + len(checked[softmax].drop_duplicates(["tokens", "image", "layer", "head"]))
    assert check["units_checked"] == units >= 1
    assert check["max_abs_dev"] == checked["ref_max_abs_dev"].max()
    assert f"Reference check: {units} unit(s) were re-run on the float64 reference" in page
