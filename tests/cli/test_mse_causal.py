"""``randattn mse --mask``: causal runs end to end, refusals, the file's own mask, per-position tables, resume, Dask,
and the figure and report section that read them."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from randattn.activations import make_activations, save_activations
from randattn.cli import main
from randattn.estimators.registry import get_spec

TOKENS = 11
#: the log2 buckets of 11 positions: (lo, hi, queries)
BUCKETS = [(1, 1, 1), (2, 3, 2), (4, 7, 4), (8, 11, 4)]


def _arrays(seed=3):
    rng = np.random.default_rng(seed)
    return {layer: tuple(0.8 * rng.normal(size=(2, 2, TOKENS, 4)) for _ in range(3)) for layer in (0, 1)}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("causal")
    meta = {"scale": 0.5, "model": "synthetic", "layout": "sequence"}
    plain = save_activations(make_activations(_arrays(), meta), folder / "plain.safetensors")
    marked = save_activations(make_activations(_arrays(), {**meta, "mask": "causal"}), folder / "lm.safetensors")
    return plain, marked


def _invoke(*args):
    return CliRunner().invoke(main, ["mse", *map(str, args)], catch_exceptions=False)


def _causal_estimators():
    """ra and softmax always; rfa and eva as soon as their specs declare the causal mask."""
    return ["ra", "softmax", *(name for name in ("rfa", "eva") if get_spec(name).supports_mask("causal"))]


@pytest.fixture(scope="module")
def causal_run(files, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "causal.parquet"
    args = [a for name in _causal_estimators() for a in ("-e", name)]
    result = _invoke(files[0], "--mask", "causal", *args, "--samples", "4", "--replicates", "3", "--out", out)
    assert result.exit_code == 0, result.output
    return out, result


def test_a_causal_run_writes_its_table_and_positions_beside_it(causal_run):
    out, result = causal_run
    table = pd.read_parquet(out)
    positions = pd.read_parquet(out.with_name("causal.positions.parquet"))
    labels = _causal_estimators()
    assert set(table.label) == set(labels) and set(table["mask"]) == {"causal"}
    assert set(positions.label) == set(labels) and set(positions["mask"]) == {"causal"}
    for _, cell in positions.groupby(["layer", "image", "head", "label"]):
        assert list(zip(cell.position_lo, cell.position_hi, cell.queries)) == BUCKETS
    assert positions[positions.label == "softmax"].mse.max() < 1e-12  # float32 round-off of the exact estimator
    meta = json.loads(out.with_name("causal.parquet.meta.json").read_text())
    assert meta["mask"] == "causal" and meta["config"]["mask"] == "causal"
    assert meta["config_identity"]["mask"] == "causal"
    side = json.loads(out.with_name("causal.positions.parquet.meta.json").read_text())
    assert side["positions_of"] == "causal.parquet"
    text = " ".join(result.output.split())
    assert "attention MSE under the causal mask" in text and "MSE by query position" in text
    assert "per-position rows to" in text


def test_an_estimator_without_causal_support_exits_2_with_its_reason(files, tmp_path):
    out = tmp_path / "r.parquet"
    result = _invoke(files[0], "--mask", "causal", "-e", "ra", "-e", "lara", "--out", out)
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "estimator 'lara' does not support mask='causal' (it supports: none): its proposals are built from " \
           "landmarks that pool every query and key" in text
    assert not out.exists() and not out.with_name("r.parquet.parts").exists()


def test_the_file_mask_is_the_default_and_mask_none_overrides_it(files, tmp_path):
    common = ["-e", "ra", "--samples", "4", "--replicates", "3", "--layers", "1", "--no-diagnostics"]
    result = _invoke(files[1], *common, "--out", tmp_path / "file.csv")
    assert result.exit_code == 0, result.output
    assert set(pd.read_csv(tmp_path / "file.csv")["mask"]) == {"causal"}
    assert (tmp_path / "file.positions.csv").exists()
    result = _invoke(files[1], *common, "--mask", "none", "--out", tmp_path / "none.csv")
    assert result.exit_code == 0, result.output
    assert set(pd.read_csv(tmp_path / "none.csv")["mask"]) == {"none"}
    assert not (tmp_path / "none.positions.csv").exists()
    refused = _invoke(files[1], "-e", "lara", "--out", tmp_path / "lara.csv")
    assert refused.exit_code == 2
    assert "the mask is the activation file's own metadata 'mask'; --mask none" in " ".join(refused.output.split())


def test_position_buckets_option(files, tmp_path):
    common = [files[0], "-e", "ra", "--samples", "4", "--replicates", "3", "--layers", "0", "--no-diagnostics"]
    result = _invoke(*common, "--position-buckets", "1,4", "--out", tmp_path / "b.parquet")
    assert result.exit_code == 0, result.output
    positions = pd.read_parquet(tmp_path / "b.positions.parquet")
    assert sorted(set(zip(positions.position_lo, positions.position_hi))) == [(1, 3), (4, TOKENS)]
    assert set(positions["mask"]) == {"none"}  # a bidirectional run, bucketed on request
    bad = _invoke(*common, "--position-buckets", "4,2")
    assert bad.exit_code == 2 and "--position-buckets '4,2': use log2, none" in " ".join(bad.output.split())


def test_an_interrupted_causal_run_resumes_to_the_same_positions(files, tmp_path, monkeypatch):
    from randattn.analysis import execute

    args = [files[0], "--mask", "causal", "-e", "ra", "-e", "softmax", "--samples", "4,8", "--replicates", "3",
            "--no-diagnostics"]
    assert _invoke(*args, "--out", tmp_path / "full.parquet").exit_code == 0
    original, calls = execute.UnitRunner.run_timed, []

    def interrupt_after_three(self, unit, **kwargs):
        calls.append(unit)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return original(self, unit, **kwargs)

    monkeypatch.setattr(execute.UnitRunner, "run_timed", interrupt_after_three)
    out = tmp_path / "cut.parquet"
    cut = CliRunner().invoke(main, ["mse", *map(str, args), "--out", str(out)])
    assert cut.exit_code == 130, cut.output
    assert len(list(out.with_name("cut.parquet.parts").glob("positions-*.parquet"))) == 3
    monkeypatch.undo()
    resumed = _invoke(*args, "--out", out, "--resume")
    assert resumed.exit_code == 0, resumed.output
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "full.positions.parquet"),
                                  pd.read_parquet(tmp_path / "cut.positions.parquet"))


@pytest.mark.slow  # two Dask worker processes (~8 s); the in-process resume test covers the positions' parts
def test_dask_workers_write_the_same_positions(files, tmp_path):
    pytest.importorskip("distributed")
    args = [files[0], "--mask", "causal", "-e", "ra", "--samples", "4", "--replicates", "3", "--no-diagnostics",
            "--threads", "1"]
    assert _invoke(*args, "--out", tmp_path / "local.parquet").exit_code == 0
    result = _invoke(*args, "--out", tmp_path / "dask.parquet", "--scheduler", "processes:2")
    assert result.exit_code == 0, result.output
    local, dask = (pd.read_parquet(tmp_path / f"{name}.positions.parquet") for name in ("local", "dask"))
    pd.testing.assert_frame_equal(local, dask)


@pytest.mark.slow  # 3-5 s on the 2-core AVX2 machine: in the slow target
def test_plot_position_and_the_report_section(causal_run, tmp_path):
    out, _ = causal_run
    result = CliRunner().invoke(main, ["plot", str(out), "--kind", "position", "--out", str(tmp_path / "figs"),
                                       "--format", "png", "--samples", "4"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "figs" / "position.png").stat().st_size > 1000
    result = CliRunner().invoke(main, ["report", str(out), "--out", str(tmp_path / "rep")], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    page = (tmp_path / "rep" / "report.html").read_text()
    assert '<h2 id="positions">Causal attention: error by position</h2>' in page
    assert 'href="#positions"' in page and 'id="fig-position"' in page
    assert "measured under the causal mask on every layer" in page
    assert "<h3>Mean MSE by position bucket, S = 4</h3>" in page


def test_plot_position_without_a_positions_table_exits_2(files, tmp_path):
    out = tmp_path / "plain.parquet"
    assert _invoke(files[0], "-e", "ra", "--samples", "4", "--replicates", "3", "--layers", "0",
                   "--no-diagnostics", "--out", out).exit_code == 0
    result = CliRunner().invoke(main, ["plot", str(out), "--kind", "position", "--out", str(tmp_path / "f")])
    assert result.exit_code == 2
    assert "no per-position table beside" in " ".join(result.output.split())


def test_a_file_with_sliding_window_and_causal_layers_gets_a_row_and_a_panel_per_mask(tmp_path):
    """A Gemma-like file (layer 0 a window of 4 keys, layer 1 causal): the estimators that declare ``sliding`` run
    on both layers, and the terminal's MSE, keys-read and per-position tables and the per-position figure name the
    mask of each row or panel, so that no number mixes the two."""
    meta = {"scale": 0.5, "model": "synthetic", "layout": "sequence", "mask": {"0": "sliding:4", "1": "causal"}}
    path = save_activations(make_activations(_arrays(), meta), tmp_path / "gemma-like.safetensors")
    out = tmp_path / "mixed.parquet"
    result = CliRunner().invoke(main, ["mse", str(path), "-e", "topk", "-e", "ra", "--samples", "2", "--replicates",
                                       "2", "--out", str(out)], catch_exceptions=False, terminal_width=200)
    assert result.exit_code == 0, result.output
    table = pd.read_parquet(out)
    assert table.groupby("layer")["mask"].unique().map(tuple).to_dict() == {0: ("sliding:4",), 1: ("causal",)}
    lines = result.output.splitlines()
    for title in ("attention MSE under", "keys read and relative error", "MSE by query position"):
        start = next(i for i, line in enumerate(lines) if title in line)
        header = next(line for line in lines[start:] if "estimator" in line)
        rows = [line for line in lines[start:start + 12] if line.startswith("│ topk")]
        assert "mask" in header, title
        assert sorted(row.split("│")[3 if "MSE under" not in title else 4].strip() for row in rows[:2]) == \
            ["causal", "sliding:4"], (title, rows)
    from randattn.reports.figures import position_figure

    figure = position_figure(pd.read_parquet(tmp_path / "mixed.positions.parquet"))
    assert sorted(ax.get_title() for ax in figure.axes if ax.get_title()) == ["S = 2, causal mask",
                                                                              "S = 2, sliding:4 mask"]


def test_mask_sliding_w_on_the_command_line_is_the_files_own_window(files, tmp_path):
    """``--mask sliding:4`` on a file without masks gives the table that the same arrays give when the file records
    ``sliding:4`` for every layer and ``--mask file`` reads it (a path through the metadata, not the option), the
    seconds aside; a window that is no window is refused with exit 2 before any work."""
    meta = {"scale": 0.5, "model": "synthetic", "layout": "sequence", "mask": "sliding:4"}
    windowed = save_activations(make_activations(_arrays(), meta), tmp_path / "windowed.safetensors")
    tables = []
    for path, mask in ((files[0], "sliding:4"), (windowed, "file")):
        out = tmp_path / f"{mask.replace(':', '')}.parquet"
        result = _invoke(path, "--mask", mask, "-e", "topk", "-e", "ra", "--samples", "3", "--replicates", "2",
                         "--out", out)
        assert result.exit_code == 0, result.output
        tables.append(pd.read_parquet(out).drop(columns="seconds"))
    assert set(tables[0]["mask"]) == {"sliding:4"}
    pd.testing.assert_frame_equal(tables[0], tables[1], check_exact=True)
    for bad, says in (("sliding:0", "the window W of 'sliding:W' must be a positive integer"),
                      ("sliding", "'sliding:W' (W a positive integer), or file"),
                      ("window:4", "'sliding:W' (W a positive integer), or file")):
        result = _invoke(files[0], "--mask", bad, "-e", "topk", "--out", tmp_path / "bad.parquet")
        assert result.exit_code == 2 and says in " ".join(result.output.split())
        # worded as mse's other refused values (--queries, --samples), not as click's usage error
        assert result.output.startswith(f"error: --mask '{bad}'") and "Usage:" not in result.output
        assert not (tmp_path / "bad.parquet").exists()


def test_a_window_that_holds_every_key_is_measured_as_the_causal_mask(files, tmp_path):
    """``--mask sliding:11`` and wider on 11-token sequences see what ``--mask causal`` sees: the run says so, records
    ``causal`` and gives ``--mask causal``'s table (seconds aside), so that an estimator declaring the causal mask
    alone (RFA) is measured, not refused; ``sliding:10`` stays a window."""
    tables = {}
    for mask in ("causal", f"sliding:{TOKENS}", "sliding:99999"):
        out = tmp_path / f"{mask.replace(':', '')}.parquet"
        result = _invoke(files[0], "--mask", mask, "-e", "ra", "--samples", "3", "--replicates", "2", "--out", out)
        assert result.exit_code == 0, result.output
        tables[mask] = pd.read_parquet(out).drop(columns="seconds")
        if mask != "causal":
            assert f"holds every key of these {TOKENS}-token sequences, so it is the causal mask" in \
                " ".join(result.output.split())
            pd.testing.assert_frame_equal(tables[mask], tables["causal"], check_exact=True)
    if "causal" in get_spec("rfa").masks_of({}) and "sliding" not in get_spec("rfa").masks_of({}):
        assert _invoke(files[0], "--mask", "sliding:99999", "-e", "rfa", "--samples", "3", "--replicates", "2",
                       "--out", tmp_path / "rfa.parquet").exit_code == 0
    window = tmp_path / "window.parquet"
    assert _invoke(files[0], "--mask", f"sliding:{TOKENS - 1}", "-e", "ra", "--samples", "3", "--replicates", "2",
                   "--out", window).exit_code == 0
    assert set(pd.read_parquet(window)["mask"]) == {f"sliding:{TOKENS - 1}"}


def test_a_mask_option_that_replaces_the_files_own_masks_says_so(files, tmp_path):
    """A file recording ``{0: sliding:4, 1: causal}``: ``--mask causal`` replaces layer 0's window, ``--mask none``
    both, a mask the file records for every layer nothing (no note); a file that records no mask gets none either
    (it is bidirectional by default, not by record)."""
    meta = {"scale": 0.5, "model": "synthetic", "layout": "sequence", "mask": {"0": "sliding:4", "1": "causal"}}
    mixed = save_activations(make_activations(_arrays(), meta), tmp_path / "mixed.safetensors")
    said = {}
    for path, mask in ((mixed, "causal"), (mixed, "none"), (mixed, "file"), (files[1], "none"),
                       (files[1], "causal"), (files[0], "causal")):
        result = _invoke(path, "--mask", mask, "-e", "ra", "--samples", "3", "--replicates", "2", "--dry-run")
        assert result.exit_code == 0, result.output
        notes = [line for line in result.output.splitlines() if "replaces the mask the file records" in line]
        said[(path.stem, mask)] = notes
    tail = " (--mask file, the default, measures each layer under its own)"
    assert said[("mixed", "causal")] == ["--mask causal replaces the mask the file records for layer 0 (sliding:4)"
                                         + tail]
    assert said[("mixed", "none")] == ["--mask none replaces the mask the file records for layers 0 (sliding:4) and "
                                       "1 (causal)" + tail]
    assert said[("lm", "none")] == ["--mask none replaces the mask the file records for every layer (causal)" + tail]
    assert said[("mixed", "file")] == said[("lm", "causal")] == said[("plain", "causal")] == []
