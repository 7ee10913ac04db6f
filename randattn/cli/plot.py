"""``randattn plot``: a results table -> figure files (PNG + SVG); prints the written paths on stdout."""

from __future__ import annotations

import click

from randattn.cli._common import abort, err_console
from randattn.cli._outputs import MAX_DPI, MIN_DPI

_KINDS = ("mse-vs-samples", "error-vs-budget", "bias-variance", "heatmap", "features", "all")
#: figures that draw the per-position table beside the results (written by masked runs)
_POSITION_KINDS = ("position",)
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
              help="Figure to draw (repeatable): mse-vs-samples (LARA Fig. 1), error-vs-budget (MSE against the keys "
                   "each query reads: the sparse and sampling estimators' quality-efficiency curve), bias-variance, heatmap "
                   "(layer x head MSE), features (rfa couplings and feature maps, Performer Fig. 4), position (MSE by "
                   "query position, from the per-position table a masked run writes beside RESULTS), or all.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), required=True, help="Folder for the figures.")
@click.option("--format", "formats", default="png,svg", show_default=True, help="Comma-separated: png, svg, pdf.")
@click.option("--label", default=None, help="Heatmap: the estimator's spec (the table's label column), e.g. 'rfa:coupling=orthogonal'; "
                   "figures show it by its readable name, e.g. 'Performer (FAVOR+, orthogonal)'.")
@click.option("--samples", "num_samples", type=int, default=None,
              help="Heatmap: the number of samples S (default: the largest); position: draw this S only (default: "
                   "one panel per S).")
@click.option("--dpi", type=click.IntRange(MIN_DPI, MAX_DPI), default=150, show_default=True,
              help="Resolution of PNG files.")
@click.option("--force", is_flag=True, help="Replace figures of the same names already in --out.")
def command(results, kinds, out_dir, formats, label, num_samples, dpi, force):
    """Draw figures of a results table (CSV, Parquet or JSON written by `randattn mse` or `randattn demo`).

    Each figure is written as OUT/<kind>.png and OUT/<kind>.svg; their paths are printed on stdout. Figures of
    the same names already in OUT are replaced only with --force.
    """
    from pathlib import Path

    from randattn.cli._outputs import output_folder, refuse_to_replace, space_errors

    unknown = [k for k in kinds if k not in (*_KINDS, *_POSITION_KINDS)]
    if unknown:
        abort(f"unknown --kind {', '.join(map(repr, unknown))}; choose from {', '.join(_KINDS)}; or "
              f"{', '.join(_POSITION_KINDS)} (from the per-position table beside RESULTS)")
    # the figure kinds by name: the figures module (matplotlib, the estimators) is imported only to draw
    every = [k for k in _KINDS if k != "all"] + list(_POSITION_KINDS)
    chosen = every if "all" in kinds else list(dict.fromkeys(kinds))
    fmt = _parse_formats(formats)
    if label is not None and "heatmap" not in chosen:
        abort("--label and --samples choose the heatmap's estimator and S; add --kind heatmap")
    if num_samples is not None and not {"heatmap", *_POSITION_KINDS} & set(chosen):
        abort("--samples chooses the S of the heatmap and the position figure; add --kind heatmap or --kind position")
    refuse_to_replace(Path(out_dir), [f"{kind}.{f}" for kind in chosen for f in fmt], force)
    # the folder is made before reading or drawing anything, and taken back if the command fails
    with output_folder(out_dir) as folder, space_errors(folder):
        _draw(results, kinds, chosen, folder, fmt, label, num_samples, dpi)


def _draw(results, kinds, chosen, out_dir, fmt, label, num_samples, dpi) -> None:
    from pathlib import Path

    from randattn.cli._errors import said
    from randattn.reports.figures import feature_variants_left_out, make_figure, save_figure
    from randattn.results.table import ResultsError, read_results

    try:
        loaded = read_results(results, main_table=True)
    except ResultsError as exc:  # a per-position table among them, in this command's words
        abort(said(exc))
    written = []
    for kind in chosen:
        options = {"metadata": loaded.metadata}
        if kind in ("heatmap", *_POSITION_KINDS):
            options.update(num_samples=num_samples, **({"label": label} if kind == "heatmap" else {}))
        source = loaded.table
        if kind in _POSITION_KINDS:
            if loaded.positions is None:
                from randattn.results.table import positions_path

                message = (f"no per-position table beside {results} (expected {positions_path(results)}); "
                           "randattn mse writes one under a mask (--mask causal) or with --position-buckets")
                if "all" in kinds:
                    err_console.print(f"[yellow]skipped[/] {kind}: {message}", highlight=False)
                    continue
                abort(f"{kind}: {message}")
            source = loaded.positions
        try:
            figure = make_figure(kind, source, **options)
        except ResultsError as exc:
            if "all" in kinds and kind in ("features", "error-vs-budget", *_POSITION_KINDS):
                err_console.print(f"[yellow]skipped[/] {kind}: {exc}")
                continue
            abort(str(exc))  # the library's message names the figure
        if kind == "features":
            left_out, why = feature_variants_left_out(source)
            if left_out:
                from rich.markup import escape

                err_console.print(f"[yellow]note[/] features: not drawn: {escape('; '.join(left_out))} ({why})",
                                  highlight=False)
        written += save_figure(figure, Path(out_dir) / kind, fmt, dpi=dpi)
    for path in written:
        click.echo(str(path))
    err_console.print(f"wrote {len(written)} file(s) to {out_dir}")
