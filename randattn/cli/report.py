"""``randattn report``: a results table -> one self-contained HTML page (tables, figures, diagnostics)."""

from __future__ import annotations

import click

from randattn.cli._common import abort, err_console
from randattn.cli._outputs import MAX_DPI, MIN_DPI


@click.command("report")
@click.argument("results", type=click.Path(dir_okay=False))
@click.option("--out", "out_dir", type=click.Path(file_okay=False), required=True, help="Folder for report.html.")
@click.option("--name", default="report.html", show_default=True, help="File name of the page.")
@click.option("--dpi", type=click.IntRange(MIN_DPI, MAX_DPI), default=110, show_default=True,
              help="Resolution of the embedded figures.")
@click.option("--force", is_flag=True, help="Replace a page of the same name already in --out.")
def command(results, out_dir, name, dpi, force):
    """Write an HTML report of a results table (CSV, Parquet or JSON) that opens offline.

    The page embeds its figures (PNG) and CSS, and lists the summary tables, importance-sampling
    diagnostics, the command that produced the results and the software environment; a masked run's
    per-position table beside RESULTS (<stem>.positions<suffix>) adds a section on the error by query
    position. Its path is printed on stdout. A page of the same name already in OUT is replaced only
    with --force.
    """
    from pathlib import Path

    from randattn.cli._outputs import output_folder, refuse_to_replace, space_errors

    if not name.endswith(".html") or "/" in name or "\\" in name:
        abort(f"--name must be a file name ending in .html, got {name!r}")
    refuse_to_replace(Path(out_dir), [name], force)
    # the folder is made before reading or rendering anything, and taken back if the command fails
    with output_folder(out_dir) as folder, space_errors(folder / name):
        path = _write(results, folder, name, dpi)
    click.echo(str(path))


def _write(results, out_dir, name: str, dpi: int):
    import sys

    from randattn.reports.html import write_report
    from randattn.cli._errors import said
    from randattn.results.table import ResultsError, read_results

    try:
        loaded = read_results(results, main_table=True)
    except ResultsError as exc:  # a per-position table among them, in this command's words
        abort(said(exc))
    with err_console.status("rendering figures"):
        try:
            return write_report(loaded.table, out_dir, metadata={**loaded.metadata,
                                                                 "report_command": " ".join(sys.argv)},
                                name=name, dpi=dpi, positions=loaded.positions)
        except ResultsError as exc:
            abort(str(exc))
