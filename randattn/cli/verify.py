"""``randattn verify``: the papers' propositions as a pass/fail table (identities, closed forms, Monte Carlo)."""

from __future__ import annotations

from collections import Counter

import click

from randattn.cli._common import json_text


def _fmt(value: float) -> str:
    if value != value:  # NaN
        return "nan"
    return f"{value:.3g}" if value == 0 or 1e-3 <= abs(value) < 1e4 else f"{value:.2e}"


@click.command("verify")
@click.option("--only", "pattern", default=None, metavar="PATTERN",
              help="Run the checks whose name matches this glob (a plain word matches as a substring).")
@click.option("--quick", is_flag=True, help="Fewer Monte Carlo draws (same thresholds, larger standard errors).")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0),
              help="Run seed (>= 0); each check derives its own generator.")
@click.option("--activations", "activations", default=None, metavar="FILE",
              help="Run the data-dependent checks on a few heads of this activation file.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON on stdout.")
def command(pattern: str | None, quick: bool, seed: int, activations: str | None, as_json: bool) -> None:
    """Check the papers' propositions numerically; exit 1 when a check fails.

    Identities hold to float64 rounding; Monte Carlo checks use z-scores against the replicate
    standard error (4.5 SE: a family-wise false alarm of at most 1% over all Monte Carlo checks; the
    summary line gives the bound for the checks this run makes, with the estimators registered).

    The checks over every registered estimator (causal.prefix-invariance, decode.budget-covers-every-key,
    numerics.large-norm-stability) include installed plugins, and name the estimator that fails.
    """
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from randattn.theory import (
        MC_K_SE,
        data_from_activations,
        family_wise_false_alarm,
        mc_tested_total,
        registry,
        run_checks,
        select_checks,
    )
    from randattn.cli._common import abort, err_console, out_console

    every = registry()
    checks = select_checks(every, pattern)
    if not checks:
        families = Counter(check.name.split(".")[0] for check in every)  # in the registry's order
        abort(f"--only {pattern!r} matches no check; the {len(every)} checks are named family.result, e.g. "
              f"{every[0].name!r}, in the families " + ", ".join(f"{f} ({n})" for f, n in families.items())
              + f" (--only {next(iter(families))} runs one family)")
    data = None
    if activations is not None:
        from randattn.activations.io import load_activations

        try:
            data = data_from_activations(load_activations(activations))
        except (OSError, ValueError, KeyError) as exc:
            abort(f"cannot use --activations {activations}: {exc}")
        err_console.print(f"[dim]data-dependent checks use {data.description}[/]", highlight=False)

    progress = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                        TimeElapsedColumn(), console=err_console, transient=True)
    with progress:
        task = progress.add_task("verify", total=len(checks))

        def advance(check, result, seconds):
            progress.update(task, advance=1, description=f"{check.name} ({'ok' if result.passed else 'FAIL'})")

        results = run_checks(checks, seed=seed, quick=quick, data=data, on_result=advance)

    failed = [r for r in results if not r.passed]
    skipped = [r for r in results if r.skipped]
    summary = (f"{len(results) - len(failed)} of {len(results)} checks passed"
               + (f" ({len(skipped)} skipped: {', '.join(r.name for r in skipped)})" if skipped else "")
               + (f"; failed: {', '.join(r.name for r in failed)}" if failed else "")
               + f" (seed {seed}{', quick' if quick else ''}"
               + (f"; Monte Carlo at {MC_K_SE:g} SE, family-wise false alarm <= {family_wise_false_alarm(checks):.2%}"
                  if mc_tested_total(checks) else "; no Monte Carlo check") + ")")
    if as_json:
        records = []
        for check, result in zip(checks, results):
            record = result.as_dict()
            record.update(claim=check.claim, source=check.source, method=check.method_label,
                          inputs="user data" if (data is not None and check.uses_data) else (check.synthetic_note or "synthetic"))
            records.append(record)
        click.echo(json_text({"results": records, "passed": not failed, "summary": summary, "seed": seed,
                              "quick": quick, "data": None if data is None else data.description}))
    else:
        table = Table(title="randattn verify", show_lines=False)
        table.add_column("check", no_wrap=True)
        for col in ("source", "method", "measured", "tolerance", "pass"):
            table.add_column(col, overflow="fold")
        for check, result in zip(checks, results):
            mark = "[yellow]skipped[/]" if result.skipped else "[green]yes[/]" if result.passed else "[bold red]NO[/]"
            table.add_row(check.name, check.source, check.method_label, _fmt(result.measured),
                          f"{result.comparison} {_fmt(result.tolerance)}", mark)
        out_console.print(table)
        for result in failed:
            err_console.print(f"[red]{result.name}[/]: {result.details}", highlight=False)
        for result in skipped:
            err_console.print(f"[yellow]{result.name}[/]: {result.details}", highlight=False)
        out_console.print(summary, highlight=False)
    if failed:
        raise SystemExit(1)
