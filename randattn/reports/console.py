"""``randattn mse``'s results as rich renderables and lines of rich markup, for a console to print.

Nothing here prints: each function takes a table, a plan or records and returns what to show, so that a
notebook or another front end can show the same as the command line.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

__all__ = [
    "broken_promise_lines",
    "budget_table",
    "count",
    "duration",
    "interrupted_text",
    "plan_lines",
    "positions_table",
    "reference_check_line",
    "summary_table",
    "warning_lines",
]


def count(n: int, word: str) -> str:
    """``"1 unit"``, ``"3 units"``: ``n`` and ``word``, plural when ``n`` is not 1."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def duration(seconds: float) -> str:
    """A wall time in the unit a reader wants: ``"4.2 s"``, ``"37 s"``, ``"12 min"``, ``"1.5 h"``."""
    if seconds < 60:
        return f"{seconds:.2g} s" if seconds < 10 else f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def plan_lines(plan, timing: bool, dask: bool = False, noun: str = "image") -> list[str]:
    """The plan in words (rich markup): two lines (cells, units, selection; memory), three with the wall time.

    Parameters
    ----------
    plan : SweepPlan
        :func:`randattn.analysis.sweep.plan_sweep`'s.
    timing : bool
        Add the wall-time line (when the plan has one).
    dask : bool
        Units run on Dask workers (the time line says they share it).
    noun : str
        What an entry of the activations is (:func:`randattn.reports.tables.item_noun`): image or sequence.
    """
    from randattn.reports.tables import queries_noun

    config = plan.config
    pairs = sum(len(config.num_samples) if e.needs_samples else 1 for e in config.estimators)
    n_layers, n_heads, n_images = len(plan.layers), len(plan.heads), len(plan.images)
    first = (f"[bold]plan[/]: {count(plan.cells, 'cell')} in {count(len(plan.units), 'unit')} = {count(n_layers, 'layer')} x "
             f"{count(n_heads, 'head')} x {count(n_images, noun)} x {pairs} (estimator, S) "
             f"{'pair' if pairs == 1 else 'pairs'}, R = {config.replicates}"
             + ("" if config.queries == "all" else f"; measuring {queries_noun(config.queries)} of each head"))
    if len(plan.todo) < len(plan.units):
        first += f"; resuming: {count(plan.todo_cells, 'cell')} left to compute"
    if plan.unreadable:
        first += (f" ({count(len(plan.unreadable), 'unreadable part')} will be set aside into corrupt/ and "
                  "computed again)")
    lines = [first, _memory_line(plan)]
    if timing and plan.seconds is not None:
        shared = "; the Dask workers share it" if dask else ""
        if len(plan.timed_heads) > 1:
            how = (f"computing {' and '.join(map(str, plan.timed_heads))} heads of each estimator and S here, timed, "
                   f"and extrapolated linearly to {count(n_heads, 'head')} per unit")
        else:  # a unit of one or two heads, timed whole
            how = f"computing one unit ({count(plan.timed_heads[0], 'head')}) of each estimator and S here, timed"
        checks = ", plus the float64 reference spot checks (--check-reference), timed once" if any(
            unit.check_reference for unit in plan.todo) else ""
        lines.append(f"[bold]wall time[/]: about {duration(plan.seconds)} of computing in this process{shared} "
                     f"(estimated by {how}{checks}; start-up and writing not included)")
    return lines


def _memory_line(plan) -> str:
    from randattn.analysis.execute import format_bytes

    budget = format_bytes(plan.config.max_memory)
    if plan.refused is not None:
        return (f"[bold]memory[/]: refused before computing: the work needs more than --max-memory {budget} "
                "(the error says what and how much)")
    if not plan.todo:
        return "[bold]memory[/]: nothing left to compute"
    memory = (f"[bold]memory[/]: the estimator work peaks at about {format_bytes(plan.peak_bytes)} "
              f"(memory model, calibrated here; --max-memory {budget}); ")
    blocked = plan.query_blocked
    queries = (f"; query blocks: {blocked} of {count(len(plan.todo), 'unit')} estimated a block of queries at a time, "
               "each with the keys it sees (the sweeps guide, Long contexts)" if blocked else "")
    if plan.split_units:
        from randattn.analysis.cell_memory import SPLIT_ROUNDING

        return memory + (f"{plan.split_units} of {len(plan.todo)} units are split into smaller blocks to fit it "
                         f"({SPLIT_ROUNDING})") + queries
    return memory + "every unit runs in its canonical blocks" + queries


def warning_lines(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line (rich markup) per distinct warning of a sweep, with how many units raised it and how many times
    it was raised in all (:func:`~randattn.analysis.sweep.summarize_warnings`; a record without ``units``, from
    an older table, gives its times only)."""
    from rich.markup import escape

    def how_often(r: Mapping[str, Any]) -> str:
        times = count(int(r["count"]), "time")
        return times if r.get("units") is None else f"raised by {count(int(r['units']), 'unit')}, {times} in all"

    return [f"[yellow]warning[/] ({how_often(r)}; {escape(str(r['label']))}) {r['category']}: {escape(str(r['message']))}"
            for r in records]


def reference_check_line(check: Mapping[str, Any]) -> str:
    """:func:`~randattn.analysis.records.reference_check_summary` in words (rich markup), flagged above
    :data:`~randattn.analysis.records.REFERENCE_TOLERANCE`."""
    from randattn.analysis.records import REFERENCE_TOLERANCE

    if check.get("non_finite"):  # not rounding: one form gave NaN or inf where the other did not
        return (f"[yellow]reference check[/]: {count(check['units_checked'], 'unit')} re-run on the float64 "
                f"reference; {check['max_abs_dev_label']}: one form gave a non-finite value where the other did not, "
                f"so its rows say nothing (randattn check {check['max_abs_dev_label'].split(':')[0]} compares the two)")
    ratio = check.get("max_dev_over_rmse")
    flag = ratio is not None and ratio > REFERENCE_TOLERANCE
    colour = "yellow" if flag else "green"
    measured = (f"[{colour}]reference check[/]: {count(check['units_checked'], 'unit')} re-run on the float64 "
                f"reference; largest |batched - reference| = {check['max_abs_dev']:.2e} ({check['max_abs_dev_label']})")
    if ratio is None:  # only exact cells were checked: their RMSE is rounding, no ratio to give
        return measured + " (exact estimators or cells only)"
    of = "its root mean square " if check.get("dev_over_rmse_of") == "rms" else ""  # older metadata: the largest
    measured += (f", {of}at most {ratio:.1e} of a cell's RMSE ({check['max_dev_over_rmse_label']}, "
                 f"{check['max_dev_over_rmse_dtype']})")
    if not flag:
        return measured
    # float64 helps only where a unit above the tolerance ran in a lower precision (older metadata: the worst's)
    dtypes = check.get("above_tolerance_dtypes") or [check["max_dev_over_rmse_dtype"]]
    if any(dtype != "float64" for dtype in dtypes):
        return measured + f" -- above {REFERENCE_TOLERANCE:g}: rerun with --dtype float64"
    return measured + (f" -- above {REFERENCE_TOLERANCE:g} although computed in float64, so not float32 rounding: "
                       "the batched form departs from its reference (randattn check NAME compares the two)")


def interrupted_text(parts, stored: set[str], plan, resume_command: str) -> str:
    """What an interrupted run kept and how to continue it (rich markup).

    Parameters
    ----------
    parts : path or None
        The run's parts folder (None: no output).
    stored : set of str
        The ids of its finished units.
    plan : SweepPlan or None
        Its plan, to count the kept cells; without one, the units are counted.
    resume_command : str
        The command that continues the run.
    """
    from rich.markup import escape

    from randattn.analysis.plan import total_cells

    if not stored:
        why = "no --out" if parts is None else "no unit had finished"
        return f"[bold red]interrupted[/]: nothing was kept ({why})"
    if plan is not None:
        kept = f"{total_cells([u for u in plan.units if u.uid in stored])} of {plan.cells} cells are"
    else:
        kept = f"{len(stored)} finished unit{'s are' if len(stored) > 1 else ' is'}"
    return (f"[bold red]interrupted[/]: {kept} kept in {escape(str(parts))}\ncontinue with:\n  "
            f"{escape(resume_command)}")


def _queries_text(queries: str | None) -> str:
    """``" on the last 64 queries"``, ``" on 64 sampled queries"``; ``""`` for every query."""
    from randattn.reports.tables import queries_noun

    return "" if queries in (None, "all") else f" on {queries_noun(queries)}"


def summary_table(summary, noun: str = "image", queries: str | None = None):
    """The aggregated MSE (:func:`randattn.analysis.sweep.aggregate`) as a rich table, a row per mask when the
    layers were measured under different ones; ``noun`` (image or sequence) names what the activations hold,
    ``queries`` the run's query selection (:mod:`randattn.analysis.queries`), said in the title."""
    from rich.table import Table

    kinds = sorted(set(summary["mask"].astype(str))) if "mask" in summary else []
    masks = [kind for kind in kinds if kind != "none"]
    several = _several_masks(summary)
    under = (f" under the {' and '.join(masks)} mask{'s' if len(masks) > 1 else ''}" if masks else "")
    table = Table(title=f"attention MSE{under}{_queries_text(queries)} (mean over heads, layers, {noun}s; 95% "
                        "bootstrap CI)", caption=_few_units_note(summary, noun) or None)
    for name in ("estimator", "S", "tokens", *(["mask"] if several else []), "MSE [CI]", "bias^2", "variance",
                 "CI over"):
        table.add_column(name, justify="left" if name in ("estimator", "mask", "CI over") else "right",
                         no_wrap=name in ("estimator", "MSE [CI]"))
    for row in _once_without_s(summary).itertuples(index=False):
        ci = "" if row.mse_lo != row.mse_lo else f" [{row.mse_lo:.3g}, {row.mse_hi:.3g}]"
        table.add_row(row.label, _s_text(row), str(row.tokens), *([str(row.mask)] if several else []),
                      f"{row.mse:.4g}{ci}", f"{row.bias_sq:.3g}", f"{row.variance:.3g}",
                      f"{_over(row.ci_over, noun)} ({row.units})")
    return table


def _measured_per_bucket(positions) -> dict:
    """:func:`randattn.reports.tables.measured_per_bucket` (imported where used: the terminal starts fast)."""
    from randattn.reports.tables import measured_per_bucket

    return measured_per_bucket(positions)


def _few_units_note(summary, noun: str) -> str:
    """:func:`randattn.reports.tables.few_units_note` (imported where used: the terminal starts fast)."""
    from randattn.reports.tables import few_units_note

    return few_units_note(summary, noun=noun)


def _once_without_s(frame):
    """:func:`randattn.reports.tables.once_without_s` (imported where used: the terminal starts fast)."""
    from randattn.reports.tables import once_without_s

    return once_without_s(frame)


def _s_text(row) -> str:
    """A row's S, or "–" for a configuration that takes none (:func:`_once_without_s`)."""
    return "–" if row.s_free else str(row.num_samples)


def _several_masks(frame) -> bool:
    """Whether the layers of a run were measured under different masks (causal and sliding-window layers of one
    model): the tables then give a row per mask, named."""
    return "mask" in frame and frame["mask"].astype(str).nunique() > 1


def _over(ci_over: str, noun: str) -> str:
    """The aggregate's ``ci_over`` ("images" or "heads") in the activations' own word."""
    return f"{noun}s" if ci_over == "images" else ci_over


def positions_table(positions, seed: int, noun: str = "image"):
    """MSE by position bucket at the largest S of each estimator, as a rich table: a row per label, a column per
    bucket; ``noun`` (image or sequence) names what the activations hold."""
    from rich.table import Table

    from randattn.analysis.positions import bucket_text
    from randattn.results.summary import aggregate

    several = _several_masks(positions)
    means = aggregate(positions, n_boot=1, seed=seed, by=("position_lo", "position_hi"))  # a row per mask, too
    largest = means.groupby("label")["num_samples"].transform("max")
    means = means[means["num_samples"] == largest]
    buckets = sorted(set(zip(means["position_lo"], means["position_hi"])))
    table = Table(title=f"MSE by query position (p = n + M - N + 1; mean over heads, layers, {noun}s)")
    table.add_column("estimator", no_wrap=True)
    table.add_column("S", justify="right")
    if several:
        table.add_column("mask")
    measured = _measured_per_bucket(positions)
    for lo, hi in buckets:
        table.add_column(f"p {bucket_text(lo, hi, measured.get((int(lo), int(hi))))}", justify="right")
    from randattn.estimators.registry import takes_no_samples

    for key, group in means.groupby(["label", "num_samples", *(["mask"] if several else [])], sort=False):
        values = {(lo, hi): mse for lo, hi, mse in zip(group["position_lo"], group["position_hi"], group["mse"])}
        label, samples, *mask = (str(part) for part in key)
        table.add_row(label, "–" if takes_no_samples(label) else samples, *mask,
                      *(f"{values[b]:.3g}" if b in values else "" for b in buckets))
    return table


def budget_table(budget, noun: str = "image", queries: str | None = None):
    """The keys each query reads and the relative output error (:func:`~randattn.analysis.relative_error.
    budget_summary`) as a rich table, or None when no estimator declares its keys and no epsilon was checked.

    Columns: the keys read (mean, and as a fraction of the keys the queries see), the median and 95th percentile
    of the relative error, the epsilon checked with the mean violation rate (of the output, or of the quantity a
    promise bounds, named beside it: ``(denominator)``), and the promise (delta) with how many heads demonstrably
    break it (red), beside the most that would be flagged by chance
    (:func:`~randattn.analysis.relative_error.flags_by_chance`) and how many are flagged family-wise
    (:func:`~randattn.analysis.relative_error.familywise_broken`; left out for a table without its counts).
    """
    import math

    from rich.table import Table

    from randattn.analysis.relative_error import flags_by_chance

    def finite(column: str) -> bool:
        return column in budget and any(math.isfinite(float(x)) for x in budget[column])

    if not len(budget) or not (finite("keys_used") or finite("epsilon")):
        return None
    table = Table(title=f"keys read and relative error ||y_hat_n - y_n|| / ||y_n||{_queries_text(queries)} "
                        f"(mean over heads, layers, {noun}s)")
    several = _several_masks(budget)
    for name in ("estimator", "S", *(["mask"] if several else []), "keys used (fraction)", "rel. err. median", "p95",
                 "P(err > eps)", "promise"):
        table.add_column(name, justify="left" if name in ("estimator", "mask", "promise") else "right",
                         no_wrap=name == "estimator")

    def number(value: float, spec: str) -> str:
        return "" if not math.isfinite(float(value)) else format(float(value), spec)

    for row in _once_without_s(budget).itertuples(index=False):
        keys = "" if not math.isfinite(row.keys_used) else f"{row.keys_used:.4g} ({row.keys_fraction:.2%})"
        violation = "" if not math.isfinite(row.epsilon) else f"{row.violation_rate:.3g} at eps = {row.epsilon:g}"
        quantity = getattr(row, "violation_of", "output")
        if violation and quantity != "output":  # the rate counts the quantity the promise bounds
            violation += f" ({quantity})"
        promise = ""
        if math.isfinite(row.delta):
            familywise = _count_or_none(getattr(row, "promises_broken_familywise", None))
            familywise = "" if familywise is None else f"; family-wise: {familywise}"
            broken = (f"[bold red]broken on {row.promises_broken} of {count(row.heads, 'head')}[/] "
                      f"(<= {flags_by_chance(row.heads):.2g} expected by chance{familywise})")
            # "kept" would claim more than a test that fails to reject: a rate above delta whose interval reaches
            # delta is not shown broken, and not shown kept either
            kept = f"no head shown to break it ({count(row.heads, 'head')})"
            promise = f"delta = {row.delta:g}: " + (broken if row.promises_broken else kept)
        table.add_row(str(row.label), _s_text(row), *([str(row.mask)] if several else []), keys,
                      number(row.rel_err_median, ".3g"),
                      number(row.rel_err_p95, ".3g"), violation, promise)
    return table


def _count_or_none(value: Any) -> int | None:
    """A count of a summary as an int; None where it is missing (None, NaN or a nullable column's ``<NA>``)."""
    import pandas as pd

    return None if value is None or pd.isna(value) else int(value)


def _error_of(broken: Mapping[str, Any]) -> str:
    """``"err"`` (the relative output error), or ``"<quantity> err"`` for a promise on another quantity."""
    quantity = broken.get("violation_of", "output")
    return "err" if quantity == "output" else f"{quantity} err"


def broken_promise_lines(broken: Sequence[Mapping[str, Any]], noun: str = "image",
                         most: int | None = None) -> list[str]:
    """A red line (rich markup) per head whose configuration's (epsilon, delta) promise demonstrably fails
    (:func:`~randattn.analysis.relative_error.broken_promises`): the whole 95% interval of its violation rate is
    above delta. The error is the output's (``P(err > eps)``) unless the promise bounds another quantity
    (``P(denominator err > eps)``). Each line ends with whether the head is flagged family-wise too (nothing for a
    table without the counts that decision tests).

    At most ``most`` heads (default :data:`~randattn.reports.tables.MAX_BROKEN_HEADS_SHOWN`, as the report), those
    with the highest lower bound, in the given order; a last line counts the others."""
    from rich.markup import escape

    from randattn.reports.tables import MAX_BROKEN_HEADS_SHOWN

    def familywise(flag: Any) -> str:
        return "" if flag is None else "; flagged family-wise too" if flag else "; not flagged family-wise"

    most = MAX_BROKEN_HEADS_SHOWN if most is None else most
    strongest = sorted(range(len(broken)), key=lambda i: -broken[i]["violation_lo"])[:most]
    lines = [f"[bold red]promise broken[/]: {escape(str(b['label']))}"
             f"{'' if b['num_samples'] is None else ' S=' + str(b['num_samples'])} layer {b['layer']} head "
             f"{b['head']} {noun} {escape(str(b['image']))}: P({_error_of(b)} > {b['epsilon']:g}) = "
             f"{b['violation_rate']:.3g} "
             f"[{b['violation_lo']:.3g}, {b['violation_hi']:.3g}] > delta = {b['delta']:g}"
             f"{familywise(b.get('familywise'))}"
             for b in (broken[i] for i in sorted(strongest))]
    if len(broken) > len(lines):
        lines.append(f"[bold red]{len(broken) - len(lines)} more heads with a broken promise[/] not listed "
                     "(--json lists every one)")
    return lines
