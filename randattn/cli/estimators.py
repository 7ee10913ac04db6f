"""``randattn estimators``: the catalogue of estimators, their variants and parameters."""

from __future__ import annotations

import json

import click


@click.command("estimators")
@click.option("--json", "as_json", is_flag=True, help="Print the catalogue as JSON on stdout.")
def command(as_json: bool) -> None:
    """List every estimator: parameters with defaults and choices, complexity, randomness."""
    from rich.markup import escape
    from rich.table import Table

    from randattn.cli._common import out_console
    from randattn.estimators.registry import catalogue

    records = catalogue()
    if as_json:
        click.echo(json.dumps(records, indent=2, default=str))
        return
    table = Table(title="randattn estimators", show_lines=True)
    table.add_column("name", style="bold")
    table.add_column("what it is", max_width=44)
    table.add_column("parameters: what each means (default; choices)")
    table.add_column("complexity", max_width=22)
    table.add_column("random")
    for record in records:
        params = []
        for pname, p in record["parameters"].items():
            choices = f"; choices {' | '.join(map(str, p['choices']))}" if p["choices"] else ""
            doc = f"\n  [dim]{escape(str(p['doc']))}[/]" if p.get("doc") else ""
            params.append(f"[bold]{escape(pname)}[/] (default {escape(repr(p['default']))}{escape(choices)}){doc}")
        presets = {name: values for name, values in (record.get("presets") or {}).items() if values}
        for preset, values in presets.items():  # "paper" (the defaults) only where another preset exists
            spelled = ", ".join(f"{k}={v}" for k, v in values.items())
            params.append(f"[bold]preset={escape(preset)}[/]\n  [dim]{escape(spelled)}[/]")
        table.add_row(
            record["name"],
            f"{record['summary']}\n[dim]{record['source']}[/]",
            "\n".join(params) or "-",
            record["complexity"],
            "yes" if record["random"] else "no",
        )
    out_console.print(table)
