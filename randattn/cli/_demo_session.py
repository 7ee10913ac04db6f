"""What ``randattn demo`` and ``randattn demo-lm`` share on the terminal: the run with one progress bar per step,
numerical warnings collected and said once per kind, and the summary, the files written and the run time after.
"""

from __future__ import annotations

import re
import shlex
import sys
import time
import warnings
from typing import Any, Callable, Iterable, Sequence

from randattn.cli._common import abort, err_console, out_console

#: a number in a warning's text: counts, sizes, equation numbers, spec values
_NUMBER = re.compile(r"\d+(?:\.\d+)?(?:e-?\d+)?")


def command_line() -> str:
    """The command as typed (recorded in the demo's report)."""
    return " ".join(shlex.quote(a) for a in ["randattn", *sys.argv[1:]])


def run_steps(run: Callable[[Callable[[Any], None]], Any], *, label_width: int, missing_module: str,
              noun: str = "image") -> None:
    """Call ``run(progress)`` under a progress bar per named step (``progress(step)`` with ``step.name``,
    ``.done``, ``.total``), then print the warnings, the summary, the files and the time of its result.

    A ``ModuleNotFoundError`` exits 2 with ``missing_module`` (how to install what is missing), a ``ValueError``
    exits 2 with its message. ``noun`` (image or sequence) names what the demo's activations hold.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    start = time.perf_counter()
    with Progress(TextColumn(f"[progress.description]{{task.description:<{label_width}}}"), BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), console=err_console) as bar:
        tasks: dict[str, Any] = {}

        def on_step(step: Any) -> None:
            if step.name not in tasks:
                tasks[step.name] = bar.add_task(step.name, total=max(step.total, 1))
            bar.update(tasks[step.name], completed=step.done, total=max(step.total, 1))

        # numerical warnings arrive once per chunk; collect them and print one line per kind at the end
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                result = run(on_step)
            except ModuleNotFoundError as exc:
                abort(f"{exc}; {missing_module}")
            except ValueError as exc:
                abort(str(exc))
    elapsed = time.perf_counter() - start
    print_warnings(caught)
    print_summary(result.summary, noun)
    print_files(result.files)
    parts = ", ".join(f"{k} {v:.1f} s" for k, v in result.seconds.items() if k != "total")
    err_console.print(f"[bold green]done[/] in {elapsed:.1f} s ({parts})", highlight=False)


def print_files(files: dict[str, Any]) -> None:
    """One line per file the run wrote, in the order it wrote them: its role, then its path."""
    width = max(map(len, files), default=0) + 1
    for key, path in files.items():
        err_console.print(f"  {key:<{width}} {path}", highlight=False)


def warning_lines(caught: Iterable[warnings.WarningMessage]) -> list[tuple[str, str, int]]:
    """``(category, message, count)`` per kind of warning, most frequent first.

    A sweep re-issues each distinct warning of its units once, carrying its record (``record``:
    :func:`~randattn.analysis.sweep.summarize_warnings`): the records of the demo's sweeps are summed per
    (category, message, label), and the line says how many units raised it, its count the times in all.
    Other warnings whose messages differ in their numbers only are one kind; in its message a number that
    differs between them reads ``#`` and one they share stays (``LARA eq. 37-38``, ``lara:beta=8``,
    ``of 130 queries``).
    """
    kinds: dict[tuple[str, str], list[str]] = {}
    swept: dict[tuple[str, str, str], list[int]] = {}
    for w in caught:
        record = getattr(w.message, "record", None)
        if isinstance(record, dict):
            totals = swept.setdefault((w.category.__name__, str(record["message"]), str(record["label"])), [0, 0])
            totals[0] += int(record["units"])
            totals[1] += int(record["count"])
            continue
        message = str(w.message)
        kinds.setdefault((w.category.__name__, _NUMBER.sub("#", message)), []).append(message)
    lines = [(category, f"{label}: {message} (raised by {units} unit{'s' * (units != 1)})", times)
             for (category, message, label), (units, times) in swept.items()]
    for (category, _), messages in kinds.items():
        numbers = [_NUMBER.findall(message) for message in messages]
        texts = _NUMBER.split(messages[0])
        shown = [n[0] if len(set(n)) == 1 else "#" for n in zip(*numbers)]
        lines.append((category, texts[0] + "".join(n + t for n, t in zip(shown, texts[1:])), len(messages)))
    return sorted(lines, key=lambda line: -line[2])


def print_warnings(caught: Sequence[warnings.WarningMessage]) -> None:
    """One line per kind of warning (:func:`warning_lines`), with how often it was raised."""
    from rich.markup import escape

    for category, message, count in warning_lines(caught):
        err_console.print(f"[yellow]warning[/] ({category}, {count}x): {escape(message)}", highlight=False)


def print_summary(summary: Any, noun: str = "image") -> None:
    """The demo's summary: MSE with its CI, bias² and variance per (tokens, estimator, S); ``noun`` (image or
    sequence) names what the activations hold."""
    from rich.table import Table

    from randattn.reports.tables import few_units_note, label_order, once_without_s

    table = Table(title=f"attention MSE vs exact softmax (mean over heads, layers, {noun}s; 95% bootstrap CI)",
                  caption=few_units_note(summary, noun=noun) or None)
    for name in ("tokens", "estimator", "S", "MSE [95% CI]", "bias²", "variance", "CI over"):
        table.add_column(name, justify="left" if name in ("estimator", "CI over") else "right",
                         no_wrap=name in ("estimator", "MSE [95% CI]"))
    order = {label: i for i, label in enumerate(label_order(summary["label"]))}
    summary = summary.assign(_o=summary["label"].map(order)).sort_values(["tokens", "_o", "num_samples"],
                                                                         kind="stable")
    # a configuration that takes no samples (its spec says so: softmax, local, adaptive vAttention) is run once and
    # reported at every S; show it once per token count
    for row in once_without_s(summary).itertuples(index=False):
        ci = "" if row.mse_lo != row.mse_lo else f" [{row.mse_lo:.3g}, {row.mse_hi:.3g}]"
        table.add_row(str(row.tokens), row.label, "–" if row.s_free else str(row.num_samples),
                      f"{row.mse:.4g}{ci}", f"{row.bias_sq:.3g}", f"{row.variance:.3g}",
                      f"{noun + 's' if row.ci_over == 'images' else row.ci_over} ({row.units})")
    out_console.print(table)
