"""``randattn mse``: activations -> bias / variance / MSE table per (image, layer, head, estimator, S)."""

from __future__ import annotations

import json
import re
import shutil
import sys
import warnings
from pathlib import Path

import click

#: estimators run when none are named (those of them that are registered)
DEFAULT_ESTIMATORS = ("rfa", "lara", "ra", "eva")
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``"2GiB"``, ``"500MB"``, ``"1e9"`` or ``"1073741824"`` -> bytes."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", str(text))
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"--max-memory: cannot read {text!r}; use e.g. 2GiB, 500MB or a number of bytes")
    try:
        value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    except ValueError:
        raise ValueError(f"--max-memory: cannot read {text!r}; use e.g. 2GiB, 500MB or a number of bytes") from None
    if not value >= 1:
        raise ValueError(f"--max-memory must be at least 1 byte, got {text!r}")
    return int(value)


def parse_int_list(name: str, text: str | None) -> tuple[int, ...] | None:
    """``"0,2,5-7"`` -> ``(0, 2, 5, 6, 7)``; None stays None (all)."""
    if text is None:
        return None
    values: list[int] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            if re.fullmatch(r"\d+-\d+", item):
                lo, hi = map(int, item.split("-"))
                if hi < lo:
                    raise ValueError
                values.extend(range(lo, hi + 1))
            else:
                values.append(int(item))
        except ValueError:
            raise ValueError(f"{name}: cannot read {item!r} in {text!r}; use integers and ranges like 0,2,5-7") from None
    if not values:
        raise ValueError(f"{name}: no values in {text!r}")
    return tuple(dict.fromkeys(values))


@click.command("mse")
@click.argument("acts", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--estimators", "estimator_list", default=None, metavar="SPECS",
              help="';'-separated estimators with options, e.g. \"rfa;rfa:coupling=orthogonal,feature_map=hyperbolic;ra\". "
                   "Default: rfa, lara, ra, eva (those registered).")
@click.option("-e", "--estimator", "estimator_items", multiple=True, metavar="SPEC",
              help="One estimator (name or name:param=value,...); repeatable, adds to --estimators.")
@click.option("--samples", default="16,32,64,128,256", show_default=True, help="Sample counts S, comma-separated.")
@click.option("--replicates", default=16, show_default=True, type=int, help="Replicates R per cell (random estimators).")
@click.option("--layers", default=None, help="Layer ids, e.g. 0,3,6-11 (default: all).")
@click.option("--heads", default=None, help="Head indices (default: all).")
@click.option("--images", default=None, help="Image indices (default: all).")
@click.option("--seed", default=0, show_default=True, type=int, help="Master seed; each cell's seed derives from it.")
@click.option("--backend", type=click.Choice(["reference", "torch"]), default="reference", show_default=True)
@click.option("--device", default=None, help="torch device (cpu, cuda, cuda:1); torch backend only.")
@click.option("--dtype", type=click.Choice(["float32", "float64"]), default="float32", show_default=True,
              help="torch dtype (the reference is always float64).")
@click.option("--max-memory", default="2GiB", show_default=True, help="Approximate memory budget of one chunk.")
@click.option("--probabilities/--no-probabilities", default=True, show_default=True,
              help="Also measure the MSE of the attention probabilities.")
@click.option("--diagnostics/--no-diagnostics", default=True, show_default=True,
              help="Importance-sampling diagnostics (ESS, delta-method variance, Pareto k-hat) where available.")
@click.option("--resume", is_flag=True, help="Continue an interrupted run with the same --out and options.")
@click.option("--out", "out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Result table: .parquet, .csv or .json (metadata in <out>.meta.json).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
def command(acts, estimator_list, estimator_items, samples, replicates, layers, heads, images, seed, backend, device,
            dtype, max_memory, probabilities, diagnostics, resume, out, as_json) -> None:
    """Measure bias, variance and MSE of estimators on the activations in ACTS.

    One row per (image, layer, head, estimator, S); summary averaged as LARA app. H.1
    (heads and layers per image, then images) with bootstrap CIs.

    \b
    Examples:
      randattn mse acts.safetensors --estimators "rfa;ra" --samples 16,64 --out mse.parquet
      randattn mse acts.safetensors -e rfa:coupling=orthogonal -e ra:variant=biased --json
      randattn mse acts.safetensors --backend torch --device cuda --out mse.csv --resume
    """
    from randattn.cli._common import err_console

    config, activations, parts = _prepare(acts, estimator_list, estimator_items, samples, replicates, layers, heads,
                                          images, seed, backend, device, dtype, max_memory, probabilities,
                                          diagnostics, resume, out)
    table = _run(activations, config, parts, resume, err_console)
    from randattn.analysis.sweep import aggregate, table_records, write_table

    summary = aggregate(table, seed=seed)
    if out is not None:
        metadata = _metadata(config, activations, out)
        write_table(table, out, metadata)
        shutil.rmtree(parts, ignore_errors=True)
        err_console.print(f"wrote {len(table)} rows to [bold]{out}[/] (metadata: {out.name}.meta.json)", highlight=False)
    if as_json:
        click.echo(json.dumps(table_records(summary), indent=2))
    else:
        _print_summary(summary)


def _prepare(acts, estimator_list, estimator_items, samples, replicates, layers, heads, images, seed, backend, device,
             dtype, max_memory, probabilities, diagnostics, resume, out):
    """Parse and validate every option; user errors exit 2 with a message."""
    from randattn.cli._common import abort

    from randattn.activations import load_activations
    from randattn.analysis.sweep import OUTPUT_FORMATS, SweepConfig, count_cells, parse_estimator_list
    from randattn.estimators.registry import list_estimators

    try:
        activations = load_activations(acts)
    except (OSError, ValueError, TypeError) as exc:
        abort(f"cannot read activations: {exc}")
    texts = [t for t in ([estimator_list] if estimator_list else []) + list(estimator_items)]
    if not texts:
        available = list_estimators()
        texts = [";".join(name for name in DEFAULT_ESTIMATORS if name in available)]
    try:
        estimators = parse_estimator_list(texts)
        num_samples = parse_int_list("--samples", samples)
        memory = parse_bytes(max_memory)
        config = SweepConfig(
            estimators=estimators, num_samples=num_samples, replicates=replicates, seed=seed, backend=backend,
            device=device, dtype=dtype, max_memory=memory, layers=parse_int_list("--layers", layers),
            heads=parse_int_list("--heads", heads), images=parse_int_list("--images", images),
            probabilities=probabilities, diagnostics=diagnostics,
        )
        count_cells(activations, config)
    except (ValueError, TypeError) as exc:
        abort(str(exc))
    if backend == "torch" and device is not None and str(device).startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            abort(f"--device {device}: CUDA is not available here")
    parts = None
    if out is not None:
        if out.suffix.lower() not in OUTPUT_FORMATS:
            abort(f"--out {str(out)!r}: unknown suffix {out.suffix!r}; use one of {', '.join(OUTPUT_FORMATS)}")
        parts = out.with_name(out.name + ".parts")
        if parts.exists() and not resume:
            abort(f"{str(parts)!r} holds an unfinished run; add --resume to continue it, or delete the folder")
    elif resume:
        abort("--resume needs --out (the interrupted run's output path)")
    return config, activations, parts


def _run(activations, config, parts, resume, console):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from randattn.analysis.sweep import count_cells, run_sweep
    from randattn.cli._common import abort

    total = count_cells(activations, config)
    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=console,
                  transient=False) as bar:
        task = bar.add_task("mse", total=total)

        def report(p) -> None:
            s = "" if p.num_samples is None else f" S={p.num_samples}"
            bar.update(task, completed=p.done, description=f"layer {p.layer} {p.label}{s}")

        try:
            # estimators warn per call (e.g. a non-positive normalizer); collect them and report
            # each distinct warning once with its count instead of flooding the terminal
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                table = run_sweep(activations, config, parts_dir=parts, resume=resume, progress=report)
        except (FileExistsError, ValueError) as exc:
            if isinstance(exc, FileExistsError) or str(exc).startswith("cannot resume"):
                abort(str(exc))
            raise
    _report_warnings(caught, console)
    return table


def _report_warnings(caught, console) -> None:
    """One line per distinct warning (numbers stripped), with how many calls raised it."""
    from collections import Counter

    counts = Counter((w.category.__name__, re.sub(r"\d+ of \d+", "some", str(w.message))) for w in caught)
    for (category, message), count in counts.items():
        console.print(f"[yellow]warning[/] ({count} estimator calls) {category}: {message}", highlight=False, markup=True)


def _metadata(config, activations, out: Path) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    try:
        randattn_version = version("randattn")
    except PackageNotFoundError:  # a source tree that is not installed
        randattn_version = "unknown"
    return {
        "command_line": " ".join(map(_quote, ["randattn", *sys.argv[1:]])) if sys.argv else None,
        "argv": list(sys.argv),
        "seed": config.seed,
        "randattn_version": randattn_version,
        "config": config.to_json(),
        "activations": {k: activations.metadata.get(k) for k in ("model", "layers", "heads", "head_dim", "tokens",
                                                                   "images", "scale", "source")},
        "columns_doc": "see randattn.analysis.sweep.COLUMNS",
        "output": str(out),
    }


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(str(arg))


def _print_summary(summary) -> None:
    from rich.table import Table

    from randattn.cli._common import out_console

    table = Table(title="attention MSE (mean over heads, layers, images; 95% bootstrap CI)")
    for name in ("estimator", "S", "tokens", "MSE [CI]", "bias^2", "variance", "CI over"):
        table.add_column(name, justify="left" if name in ("estimator", "CI over") else "right",
                         no_wrap=name in ("estimator", "MSE [CI]"))
    for row in summary.itertuples(index=False):
        ci = "" if row.mse_lo != row.mse_lo else f" [{row.mse_lo:.3g}, {row.mse_hi:.3g}]"
        table.add_row(row.label, str(row.num_samples), str(row.tokens), f"{row.mse:.4g}{ci}", f"{row.bias_sq:.3g}",
                      f"{row.variance:.3g}", f"{row.ci_over} ({row.units})")
    out_console.print(table)
