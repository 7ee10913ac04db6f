"""``randattn check``: hold an estimator, built-in or plugin, to the conformance kit."""

from __future__ import annotations

import json

import click


@click.command("check")
@click.argument("target", metavar="NAME_OR_MODULE:OBJECT")
@click.option("-p", "--param", "param_items", multiple=True, metavar="NAME=VALUE",
              help="A parameter of the configuration to check (repeatable); default: the estimator's defaults.")
@click.option("--check", "check_names", multiple=True, metavar="CHECK",
              help="Run only this check (repeatable); names as in the table.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON on stdout.")
def command(target: str, param_items: tuple[str, ...], check_names: tuple[str, ...], as_json: bool) -> None:
    """Run randattn's conformance checks on an estimator: a registered NAME, or MODULE:OBJECT holding an
    EstimatorSpec (registered or not). Prints a pass/fail table; exit 1 when a check fails."""
    from rich.markup import escape
    from rich.table import Table

    from randattn.cli._common import abort, out_console
    from randattn.cli._errors import said
    from randattn.estimators.registry import parse_estimator
    from randattn.testing import CHECKS, SPEC_TARGETS, SpecTargetError, check_estimator, load_spec
    from randattn.testing.checks import configuration_refusal

    try:
        spec = load_spec(target)
    except SpecTargetError as exc:
        if exc.estimator is None:
            abort(f"{target!r} is {exc.got}; randattn check wants {SPEC_TARGETS}")
        # the -e form of randattn mse: the same configuration, with the parameters as -p options
        options = " ".join(f"-p {item if '=' in item else item + '=VALUE'}" for item in exc.params)
        abort(f"{target!r} is the estimator {exc.estimator!r} with parameters, as randattn mse -e writes it; "
              f"randattn check takes the parameters apart: randattn check {exc.estimator} {options}")
    except (TypeError, ValueError) as exc:
        abort(str(exc))
    params: dict = {}
    if param_items:
        text = ",".join(param_items)
        for item in param_items:  # each -p alone, in its own words, before they are joined as -e's options
            if "=" not in item or ("," in item and ":" not in target):
                abort(f"--param {item!r}: expected NAME=VALUE with NAME one of {', '.join(spec.params)} (one -p each)")
        try:
            if ":" in target:  # a spec that is not registered: type the values as the registry would
                from randattn.estimators.registry import _convert

                for item in param_items:
                    key, sep, raw = item.partition("=")
                    if key.strip() not in spec.params:
                        abort(f"--param {item!r}: expected NAME=VALUE with NAME one of {', '.join(spec.params)}")
                    params[key.strip()] = _convert(raw.strip(), spec.params[key.strip()].default)
            else:
                _, params = parse_estimator(f"{spec.name}:{text}")
            spec.resolve_params(params)  # each value against its parameter's check, as mse's -e is: exit 2
            refused = configuration_refusal(spec, params)  # and against the estimator's own rules
            if refused is not None:
                abort(f"estimator {spec.name!r} with {text}: {refused}")
        except (TypeError, ValueError) as exc:  # a word for a number is a TypeError of the parameter's check
            abort(said(exc))
    unknown = [c for c in check_names if c not in CHECKS]
    if unknown:
        abort(f"unknown check(s) {', '.join(map(repr, unknown))}; the checks are: {', '.join(CHECKS)}")
    try:
        report = check_estimator(spec, params, checks=list(check_names) or None, raise_on_failure=False)
    except (TypeError, ValueError) as exc:  # a parameter its options refuse
        abort(str(exc))
    if as_json:
        click.echo(json.dumps({"estimator": report.estimator, "params": dict(report.params), "passed": report.passed,
                               "results": [{k: v for k, v in r.__dict__.items() if k != "error"}
                                           for r in report.results], "notes": list(report.notes)},
                              indent=2, default=str))
    else:
        table = Table(title=f"randattn check {escape(spec.name)}", show_lines=False)
        table.add_column("check", style="bold")
        table.add_column("result")
        table.add_column("seconds", justify="right")
        table.add_column("why", max_width=110)
        style = {"passed": "green", "failed": "bold red", "skipped": "dim"}
        for r in report.results:
            table.add_row(r.check, f"[{style[r.status]}]{r.status}[/]", f"{r.seconds:.2f}", escape(r.message))
        out_console.print(table)
        failed = len(report.failures)
        skipped = sum(r.status == "skipped" for r in report.results)
        verdict = f"[bold red]{failed} failed[/]" if failed else "[green]all checks passed[/]"
        out_console.print(f"{verdict} ({skipped} not applicable)")
        for note in report.notes:
            out_console.print(f"[yellow]note[/]: {escape(note)}", soft_wrap=True)
    if not report.passed:
        raise SystemExit(1)
