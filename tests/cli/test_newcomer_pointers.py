"""Words a newcomer reads that must point somewhere and say the right thing: the report's and ``verify``'s
references name documents that exist, language-model results speak of sequences (not images), column lists name
each column once, ``--samples`` and the token-layout warning say what is allowed."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from randattn.activations import io, make_activations, save_activations
from randattn.cli import main

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _cli(*args: str):
    return CliRunner().invoke(main, [*map(str, args)])


# ------------------------------------------------------------------------------------------------ references

def _page_titles() -> dict[str, Path]:
    """Every documentation page by its first-level heading."""
    titles = {}
    for page in DOCS.rglob("*.md"):
        first = next((line for line in page.read_text(encoding="utf-8").splitlines() if line.startswith("# ")), None)
        if first:
            titles[first[2:].strip()] = page
    return titles


def test_verify_cites_documents_a_user_has():
    from randattn.theory import registry

    titles = _page_titles()
    cited = 0
    for check in registry():
        assert "ARCHITECTURE" not in check.source and "engineering rule" not in check.source, check.source
        for page, section in re.findall(r"docs: ([^,;]+?)(?:, ([^;(]+?))?(?: \(|;|$)", check.source):
            cited += 1
            assert page in titles, f"{check.name}: no documentation page is titled {page!r}"
            if section:
                headings = [line.lstrip("#").strip() for line in titles[page].read_text(encoding="utf-8").splitlines()
                            if line.startswith("## ")]
                assert any(h.startswith(section) for h in headings), f"{check.name}: {page} has no section {section!r}"
    assert cited == 6  # the six checks that cited the internal design notes


def test_verify_table_shows_the_corrected_sources():
    result = _cli("verify", "--quick", "--only", "causal.mask-rule")
    assert result.exit_code == 0, result.output
    assert "│ causal.mask-rule │ docs: Causal masks │" in result.output


def test_report_warning_explanation_points_at_a_page_that_exists():
    from randattn.reports.html import WARNING_EXPLANATIONS

    text = WARNING_EXPLANATIONS["NonPositiveDenominatorWarning"]
    assert "README's findings" not in text
    assert text.endswith("weighting=balance (eq. 36) also converges; docs/guide/reading-results.md shows both on "
                         "DINOv2.")
    assert (ROOT / "docs/guide/reading-results.md").is_file()


# ------------------------------------------------------------------------------------------------ sequences

@pytest.fixture(scope="module")
def lm_results(tmp_path_factory):
    """``randattn mse`` and ``report`` on a 2-sequence, causal, language-model-layout file (random q, k, v)."""
    folder = tmp_path_factory.mktemp("lm")
    rng = np.random.default_rng(0)
    layers = {0: tuple(rng.normal(size=(2, 1, 8, 4)) for _ in range(3))}
    acts = save_activations(make_activations(layers, {"scale": 0.5, "model": "tinylm", "layout": "sequence",
                                                      "mask": "causal", "images": ["pydoc:assignment", "pydoc:for"]}),
                            folder / "lm.safetensors")
    out = folder / "lm.parquet"
    mse = _cli("mse", acts, "-e", "rfa", "--samples", "4", "--replicates", "2", "--out", out)
    return mse, out, folder


def test_mse_on_text_sequences_calls_them_sequences(lm_results):
    mse, _, _ = lm_results
    assert mse.exit_code == 0, mse.output
    text = " ".join(mse.output.split())
    assert "= 1 layer x 1 head x 2 sequences x 1 (estimator, S) pair, R = 2" in text
    assert "(mean over heads, layers, sequences; 95% bootstrap CI)" in text
    assert "sequences (2)" in text
    assert "image" not in text


def test_demo_lm_summary_calls_them_sequences(lm_results, capsys):
    from randattn.analysis.sweep import aggregate
    from randattn.cli._demo_session import print_summary

    _, out, _ = lm_results
    capsys.readouterr()
    print_summary(aggregate(pd.read_parquet(out)), "sequence")
    said = " ".join(capsys.readouterr().out.split())
    assert "attention MSE vs exact softmax (mean over heads, layers, sequences; 95% bootstrap CI)" in said
    assert "sequences (2)" in said and "image" not in said


@pytest.mark.slow  # draws the report's figures: about 5 s
def test_report_and_figures_on_text_sequences_call_them_sequences(lm_results):
    from randattn.reports.figures import mse_vs_samples_figure
    from randattn.reports.tables import describe_data
    from randattn.results import read_results

    _, out, folder = lm_results
    report = _cli("report", out, "--out", folder / "report")
    assert report.exit_code == 0, report.output
    loaded = read_results(out)
    assert describe_data(loaded.table, loaded.metadata) == ("tinylm · 2 sequences (pydoc:assignment, pydoc:for) · "
                                                            "layer 0 · 1 head · causal mask · R = 2")
    page = (folder / "report" / "report.html").read_text(encoding="utf-8")
    visible = re.sub(r"<pre>.*?</pre>|src=\"data:image/png;base64,[^\"]*\"", "", page, flags=re.S)
    assert "per (layer, head, sequence), then the mean over heads and layers of each sequence, then the mean over " \
           "sequences with a percentile bootstrap interval over sequences." in visible
    assert "<th>sequences</th>" in visible
    assert not re.search(r"\bimages?\b", visible.replace("(no external CSS, JS, fonts or images)", ""))
    figure = mse_vs_samples_figure(loaded.table, metadata=loaded.metadata)
    subtitle = " ".join(" ".join(t.get_text() for t in figure.texts).split())
    assert "mean over layers and heads per sequence, then over sequences; bands: 95% percentile bootstrap CI " \
           "over 2 sequences" in subtitle


def test_an_image_capture_keeps_its_images():
    from randattn.reports.tables import item_noun

    assert item_noun({"activations": {"layout": None, "model": "dinov2-s14"}}) == "image"
    assert item_noun({"activations": {"layout": "sequence"}}) == "sequence"
    assert item_noun({"layout": "sequence"}) == "sequence"  # an activation file's own metadata
    assert item_noun(None) == "image"


# ------------------------------------------------------------------------------------------------ messages

def test_missing_columns_are_named_once():
    from randattn.reports.tables import PLOT_COLUMNS, ResultsError, require_columns

    table = pd.DataFrame({"image": ["a"], "layer": [0]})
    with pytest.raises(ResultsError) as caught:
        require_columns(table, [*PLOT_COLUMNS, "mse"], "the MSE-vs-samples figure")
    assert str(caught.value) == ("the MSE-vs-samples figure needs the column(s) head, tokens, estimator, label, "
                                 "num_samples, mse; the table has image, layer")


@pytest.fixture(scope="module")
def acts_file(tmp_path_factory):
    rng = np.random.default_rng(1)
    layers = {0: tuple(rng.normal(size=(1, 1, 5, 4)) for _ in range(3))}
    meta = {"scale": 0.5, "model": "synthetic", "layout": "sequence"}
    return save_activations(make_activations(layers, meta), tmp_path_factory.mktemp("a") / "a.safetensors")


@pytest.mark.parametrize(
    ("samples", "message"),
    [
        ("0", "error: --samples: every S must be >= 1 (samples per estimate), got '0'"),
        ("16,0", "error: --samples: every S must be >= 1 (samples per estimate), got '16,0'"),
        ("x", "error: --samples: cannot read 'x' in 'x'; use integers and ranges like 16,64 or 4-8"),
    ],
)
def test_samples_errors_offer_only_what_is_allowed(acts_file, tmp_path, samples, message):
    result = _cli("mse", acts_file, "--samples", samples, "--out", tmp_path / "r.parquet")
    assert result.exit_code == 2, result.output
    assert result.output.strip() == message
    assert not (tmp_path / "r.parquet").exists()


def test_a_hand_made_file_is_told_its_layout_is_unknown(tmp_path, monkeypatch):
    monkeypatch.setattr(io, "_warned_no_grid", False)
    rng = np.random.default_rng(2)
    path = save_activations(make_activations({0: tuple(rng.normal(size=(1, 1, 5, 4)) for _ in range(3))},
                                             {"scale": 0.5}), tmp_path / "mine.npz")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        io.load_activations(path)
    [said] = [str(w.message) for w in caught if issubclass(w.category, io.NoGridWarning)]
    assert said == (f"{path}: no patch 'grid' in the metadata, nor layout 'sequence', so the token layout is "
                    "unknown; estimators use 1-D (sequence) windows. For ViT patch tokens add 'grid' [rows, columns] "
                    "and 'prefix_tokens' to the metadata (randattn.activations.io.infer_grid gives the square-grid "
                    "reading); for text add \"layout\": \"sequence\". Said once per process.")


def test_the_demos_list_every_file_they_wrote(capsys):
    """``demo-lm --decode`` wrote error-vs-budget.png and .svg, its headline figure, but listed neither."""
    from pathlib import Path

    from randattn.cli._demo_session import print_files

    roles = ["table", "positions", "figure.png", "figure.svg", "error-vs-budget.png", "error-vs-budget.svg",
             "position.png", "position.svg", "report"]
    print_files({role: Path("out") / role for role in roles})
    lines = capsys.readouterr().err.splitlines()
    assert [line.split()[0] for line in lines] == roles
    assert all(line.split()[1] == str(Path("out") / role) for line, role in zip(lines, roles))
