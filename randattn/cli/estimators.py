"""``randattn estimators``: the catalogue of estimators, their variants and parameters."""

from __future__ import annotations

import json

import click


@click.command("estimators")
@click.option("--json", "as_json", is_flag=True, help="Print the catalogue as JSON on stdout.")
def command(as_json: bool) -> None:
    """List every estimator, built-in or plugin: parameters with defaults and choices, complexity, and the facts
    its spec declares (randomness, convergence, cost, masks)."""
    from rich.markup import escape
    from rich.table import Table

    from randattn.cli._common import err_console, out_console
    from randattn.estimators.registry import catalogue, plugin_errors

    records = catalogue()
    # a broken plugin is reported and left out; the catalogue of the others is still printed (exit 0)
    for error in plugin_errors():
        err_console.print(f"[bold yellow]warning:[/] {escape(str(error))}", highlight=False, soft_wrap=True)
    if as_json:
        click.echo(json.dumps(records, indent=2, default=str))
        return
    table = Table(title="randattn estimators", show_lines=True)
    table.add_column("name", style="bold", max_width=16)  # long display names wrap; the parameters get the room
    table.add_column("what it is", max_width=44)
    table.add_column("parameters: what each means (default; choices)")
    table.add_column("complexity", max_width=22)
    table.add_column("facts (defaults)", max_width=20)  # "no convergence claim"; a long mask list wraps
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
        facts = [
            "random" if record["random"] else "deterministic",
            f"{record['convergence']}" if record["convergence"] != "none" else "no convergence claim",
            f"{record['cost']} cost",
            "masks: " + ", ".join(record["masks"]),
        ]
        if record["signed_weights"]:
            facts.append("signed weights")
        if record["keys_used"]:
            facts.append("reports keys used")
        if record["promise"]:
            promise = record["promise"]
            facts.append(f"promise: P(err > {promise['epsilon']:g}) <= {promise['delta']:g} ({promise['on']})")
        if record["exact_limits"]:
            facts.append(f"exact limits: {len(record['exact_limits'])} (--json lists them)")
        origin = "" if record["origin"].startswith("entry point") and " of package randattn " in record["origin"] \
            else f"\n[dim]from {escape(record['origin'])}[/]"
        table.add_row(
            f"{record['name']}\n[dim]{escape(record['display_name'])}[/]",
            f"{record['summary']}\n[dim]{record['source']}[/]{origin}",
            "\n".join(params) or "-",
            record["complexity"],
            "\n".join(facts),
        )
    out_console.print(table)
