"""``randattn plot``: a results table -> figure files (PNG + SVG); prints the written paths on stdout."""

from __future__ import annotations

import click

from randattn.cli._common import abort, err_console, writable_output

_KINDS = ("mse-vs-samples", "bias-variance", "heatmap", "features", "all")
_FORMATS = ("png", "svg", "pdf")


def _parse_formats(text: str) -> tuple[str, ...]:
    formats = tuple(dict.fromkeys(part.strip().lower() for part in text.split(",") if part.strip()))
    bad = [f for f in formats if f not in _FORMATS]
    if bad or not formats:
        abort(f"--format must be a comma-separated subset of {', '.join(_FORMATS)}, got {text!r}")
    return formats


@click.command("plot")
@click.argument("results", type=click.Path(dir_okay=False))
@click.option("--kind", "kinds", multiple=True, default=("mse-vs-samples",), show_default=True,
              help="Figure to draw (repeatable): mse-vs-samples (LARA Fig. 1), bias-variance, heatmap "
                   "(layer x head MSE), features (rfa couplings and feature maps, Performer Fig. 4), or all.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), required=True, help="Folder for the figures.")
@click.option("--format", "formats", default="png,svg", show_default=True, help="Comma-separated: png, svg, pdf.")
@click.option("--label", default=None, help="Heatmap: the estimator's spec (the table's label column), e.g. 'rfa:coupling=orthogonal'; "
                   "figures show it by its readable name, e.g. 'Performer (FAVOR+, orthogonal)'.")
@click.option("--samples", "num_samples", type=int, default=None, help="Heatmap: the number of samples S.")
@click.option("--dpi", type=int, default=150, show_default=True, help="Resolution of PNG files.")
def command(results, kinds, out_dir, formats, label, num_samples, dpi):
    """Draw figures of a results table (CSV, Parquet or JSON written by `randattn mse` or `randattn demo`).

    Each figure is written as OUT/<kind>.png and OUT/<kind>.svg; their paths are printed on stdout.
    """
    from pathlib import Path

    from randattn.reports.figures import FIGURE_KINDS, make_figure, save_figure
    from randattn.reports.tables import ResultsError, read_results

    unknown = [k for k in kinds if k not in _KINDS]
    if unknown:
        abort(f"unknown --kind {', '.join(map(repr, unknown))}; choose from {', '.join(_KINDS)}")
    chosen = list(FIGURE_KINDS) if "all" in kinds else list(dict.fromkeys(kinds))
    fmt = _parse_formats(formats)
    if dpi <= 0:
        abort(f"--dpi must be positive, got {dpi}")
    if (label is not None or num_samples is not None) and "heatmap" not in chosen:
        abort("--label and --samples choose the heatmap's estimator and S; add --kind heatmap")
    out_dir = writable_output(out_dir, "--out", directory=True)  # before reading or drawing anything
    try:
        loaded = read_results(results)
    except ResultsError as exc:
        abort(str(exc))
    written = []
    for kind in chosen:
        options = {"metadata": loaded.metadata}
        if kind == "heatmap":
            options.update(label=label, num_samples=num_samples)
        try:
            figure = make_figure(kind, loaded.table, **options)
        except ResultsError as exc:
            if "all" in kinds and kind == "features":
                err_console.print(f"[yellow]skipped[/] features: {exc}")
                continue
            abort(f"{kind}: {exc}")
        written += save_figure(figure, Path(out_dir) / kind, fmt, dpi=dpi)
    for path in written:
        click.echo(str(path))
    err_console.print(f"wrote {len(written)} file(s) to {out_dir}")
