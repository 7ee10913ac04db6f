"""``randattn report``: a results table -> one self-contained HTML page (tables, figures, diagnostics)."""

from __future__ import annotations

import click

from randattn.cli._common import abort, err_console, writable_output


@click.command("report")
@click.argument("results", type=click.Path(dir_okay=False))
@click.option("--out", "out_dir", type=click.Path(file_okay=False), required=True, help="Folder for report.html.")
@click.option("--name", default="report.html", show_default=True, help="File name of the page.")
@click.option("--dpi", type=int, default=110, show_default=True, help="Resolution of the embedded figures.")
def command(results, out_dir, name, dpi):
    """Write an HTML report of a results table (CSV, Parquet or JSON) that opens offline.

    The page embeds its figures (PNG) and CSS, and lists the summary tables, importance-sampling
    diagnostics, the command that produced the results and the software environment; a masked run's
    per-position table beside RESULTS (<stem>.positions<suffix>) adds a section on the error by query
    position. Its path is printed on stdout.
    """
    import sys

    from randattn.reports.html import write_report
    from randattn.reports.tables import ResultsError, read_results

    if not name.endswith(".html") or "/" in name or "\\" in name:
        abort(f"--name must be a file name ending in .html, got {name!r}")
    if dpi <= 0:
        abort(f"--dpi must be positive, got {dpi}")
    out_dir = writable_output(out_dir, "--out", directory=True)  # before reading or rendering anything
    try:
        loaded = read_results(results)
    except ResultsError as exc:
        abort(str(exc))
    with err_console.status("rendering figures"):
        try:
            path = write_report(loaded.table, out_dir, metadata={**loaded.metadata,
                                                                 "report_command": " ".join(sys.argv)},
                                name=name, dpi=dpi, positions=loaded.positions)
        except ResultsError as exc:
            abort(str(exc))
    click.echo(str(path))
