"""``randattn estimators``: the catalogue of estimators, their variants and parameters."""

from __future__ import annotations

import json

import click


@click.command("estimators")
@click.option("--json", "as_json", is_flag=True, help="Print the catalogue as JSON on stdout.")
def command(as_json: bool) -> None:
    """List every estimator: parameters with defaults and choices, complexity, randomness."""
    from rich.table import Table

    from randattn.cli._common import out_console
    from randattn.estimators.registry import catalogue

    records = catalogue()
    if as_json:
        click.echo(json.dumps(records, indent=2, default=str))
        return
    table = Table(title="randattn estimators", show_lines=True)
    table.add_column("name", style="bold")
    table.add_column("what it is")
    table.add_column("parameters (default; choices)")
    table.add_column("complexity")
    table.add_column("random")
    for record in records:
        params = []
        for pname, p in record["parameters"].items():
            choices = f"; {' | '.join(map(str, p['choices']))}" if p["choices"] else ""
            params.append(f"{pname}={p['default']!r}{choices}")
        table.add_row(
            record["name"],
            f"{record['summary']}\n[dim]{record['source']}[/]",
            "\n".join(params) or "-",
            record["complexity"],
            "yes" if record["random"] else "no",
        )
    out_console.print(table)
