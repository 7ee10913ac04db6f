"""``randattn mse``: activations -> bias / variance / MSE table per (image, layer, head, estimator, S)."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import sys
import warnings
from pathlib import Path
from typing import NoReturn

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
@click.option("--backend", type=click.Choice(["torch", "reference"]), default="torch", show_default=True,
              help="torch: the batched estimators (checked against the reference, see --check-reference); "
                   "reference: the float64 numpy definitions (slow).")
@click.option("--device", default=None, help="torch device (cpu, cuda, cuda:1); torch backend only.")
@click.option("--dtype", type=click.Choice(["auto", "float32", "float64"]), default="auto", show_default=True,
              help="torch dtype; auto: float64 for signed-weight estimators (LARA decoupled or coupled, "
                   "trigonometric RFA; LARA's implied-probability product in float32 where a rounding bound shows "
                   "it moves the probability MSE by < 1e-3 of itself), float32 otherwise. The reference is always "
                   "float64.")
@click.option("--check-reference", "check_reference", default=0.02, show_default=True, type=float, metavar="FRACTION",
              help="Re-run this fraction of units (at least one per estimator) on the float64 reference with the "
                   "same draws and report the largest deviation; 0 turns it off.")
@click.option("--max-memory", default="2GiB", show_default=True, help="Approximate memory budget of the estimator work.")
@click.option("--probabilities/--no-probabilities", default=True, show_default=True,
              help="Also measure the MSE of the attention probabilities.")
@click.option("--diagnostics/--no-diagnostics", default=True, show_default=True,
              help="Importance-sampling diagnostics (ESS, delta-method variance, Pareto k-hat) where available.")
@click.option("--resume", is_flag=True, help="Continue an interrupted run with the same --out and options.")
@click.option("--force", "--overwrite", "force", is_flag=True,
              help="Replace an existing --out table and any unfinished run of it (--overwrite: the same).")
@click.option("--dry-run", "dry_run", is_flag=True,
              help="Print the plan -- cells, units, estimated wall time and peak memory -- and exit without "
                   "writing anything (the time is measured by computing one and two heads of each estimator and S).")
@click.option("--out", "out", type=click.Path(path_type=Path), default=None,
              help="Result table: .parquet, .csv or .json (metadata in <out>.meta.json).")
@click.option("--threads", type=int, default=None, metavar="N",
              help="torch intra-op threads per process (default: torch's, usually the number of cores); recorded, "
                   "and needed to reproduce a table bit for bit: float32 rounding depends on it.")
@click.option("--scheduler", default="local", show_default=True, metavar="WHERE",
              help="Where units run: local (this process), processes:N (a local Dask cluster of N worker "
                   "processes) or tcp://HOST:PORT (a running Dask scheduler; ACTS must be readable by every worker). "
                   "The table is the same whatever the scheduler.")
@click.option("--mask", "mask_choice", type=click.Choice(["none", "causal", "file"]), default="file", show_default=True,
              help="Attention mask of every layer: none (bidirectional), causal (key m visible to query n iff "
                   "m <= n + M - N), or file: the activation file's own per-layer 'mask' metadata (a language-model "
                   "capture records it; a file without it is bidirectional). Estimators, the exact softmax and the "
                   "probabilities all apply it; an estimator that does not support it is refused by name.")
@click.option("--position-buckets", "position_buckets", default=None, metavar="log2|none|EDGES",
              help="Per-position metrics, by the query's position p = n + M - N + 1 (under the causal mask, the "
                   "number of keys it sees): log2 (1, 2-3, 4-7, ...), none, or lower edges such as 1,2,4,8,64. "
                   "Default: log2 on masked layers, none otherwise. Written to <out stem>.positions<suffix>.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
def command(acts, estimator_list, estimator_items, samples, replicates, layers, heads, images, seed, backend, device,
            dtype, check_reference, max_memory, probabilities, diagnostics, resume, force, dry_run, out, threads,
            scheduler, mask_choice, position_buckets, as_json) -> None:
    """Measure bias, variance and MSE of estimators on the activations in ACTS.

    One row per (image, layer, head, estimator, S); summary averaged as LARA app. H.1
    (heads and layers per image, then images) with bootstrap CIs.

    \b
    Examples:
      randattn mse acts.safetensors --estimators "rfa;ra" --samples 16,64 --out mse.parquet
      randattn mse acts.safetensors -e rfa:coupling=orthogonal -e ra:variant=biased --json
      randattn mse acts.safetensors --device cuda --out mse.csv --resume
      randattn mse lm.safetensors --mask causal -e rfa -e ra --out causal.parquet
      randattn mse acts.safetensors --samples 16,64,256 --dry-run
    \b
    Exit codes: 0 ok; 1 an unexpected error; 2 bad usage or input (refused before
    computing), or no space left to write an output (the message names the file);
    130 interrupted by Ctrl-C (SIGINT), 143 stopped by SIGTERM. After 2 (no space),
    130 or 143, finished units are kept beside --out and the message gives the
    --resume command that continues the run.
    """
    from randattn._process import retain_freed_memory
    from randattn.analysis.executors import parse_scheduler
    from randattn.analysis.store import SweepLockedError, sweep_lock
    from randattn.cli._common import UserError, abort, err_console, no_space_message

    retain_freed_memory()  # the sweep reuses its large blocks' pages instead of faulting them in again

    if resume and force:
        abort("--resume and --force exclude each other")
    try:
        where = parse_scheduler(scheduler)
    except ValueError as exc:
        abort(str(exc))
    if resume and out is not None:
        _check_manifest(out.with_name(out.name + ".parts"))  # before loading anything: a damaged one is said at once
    config, activations = _prepare(acts, estimator_list, estimator_items, samples, replicates, layers, heads, images,
                                   seed, backend, device, dtype, check_reference, max_memory, probabilities,
                                   diagnostics, threads, mask_choice, position_buckets)
    if dry_run:
        _dry_run(activations, config, out, resume, force, where)
        return
    if out is None:
        if resume:
            abort("--resume needs --out (the interrupted run's output path)")
        plan = None
        try:
            plan = _plan(activations, config, None, False, err_console, where)
            tables = _run(activations, config, None, False, err_console, where, acts, plan)
        except KeyboardInterrupt as exc:
            _interrupted(exc, None, plan, err_console)
        _finish(tables, config, activations, None, as_json)
        return
    out = _check_out(out)
    parts = out.with_name(out.name + ".parts")
    try:
        with sweep_lock(out):
            if _already_complete(out, parts, config, resume, force):
                from randattn.analysis.store import coerce
                from randattn.analysis.sweep import SweepTables
                from randattn.reports.tables import read_results

                err_console.print(f"{out} already holds this run, complete; nothing to do", highlight=False)
                _finish(SweepTables(coerce(read_results(out).table)), config, activations, None, as_json)
                return
            if force:
                shutil.rmtree(parts, ignore_errors=True)
            plan = None
            try:
                plan = _plan(activations, config, parts, resume, err_console, where)
                tables = _run(activations, config, parts, resume, err_console, where, acts, plan)
                _finish(tables, config, activations, out, as_json)
            except UserError:
                _drop_empty_parts(parts)  # refused before any unit finished (memory): leave nothing behind
                raise
            except KeyboardInterrupt as exc:
                _interrupted(exc, parts, plan, err_console)
            except OSError as exc:
                message = no_space_message(exc)
                if message is None:
                    raise
                abort(message + _kept(parts, then="once there is space"))
            shutil.rmtree(parts, ignore_errors=True)
    except SweepLockedError as exc:
        abort(str(exc))


def _prepare(acts, estimator_list, estimator_items, samples, replicates, layers, heads, images, seed, backend, device,
             dtype, check_reference, max_memory, probabilities, diagnostics, threads=None, mask_choice="file",
             position_buckets=None):
    """Parse and validate every option; user errors exit 2 with a message."""
    from randattn.activations import load_activations
    from randattn.analysis.plan import with_threads
    from randattn.analysis.sweep import SweepConfig, count_cells, parse_estimator_list
    from randattn.cli._common import abort
    from randattn.estimators.registry import list_estimators

    try:
        activations = load_activations(acts)
    except (OSError, ValueError, TypeError) as exc:
        abort(f"cannot read activations: {exc}")
    mask = _resolve_mask(mask_choice, activations)
    texts = [t for t in ([estimator_list] if estimator_list else []) + list(estimator_items)]
    if not texts:
        available = list_estimators()
        texts = [";".join(name for name in DEFAULT_ESTIMATORS if name in available)]
    try:
        if backend == "torch":
            from randattn._validation import check_device

            check_device(device)
        elif device not in (None, "cpu"):
            raise ValueError(f"--device {device} needs --backend torch (the reference runs on the CPU)")
        estimators = parse_estimator_list(texts)
        if replicates < 2 and any(e.random for e in estimators):
            raise ValueError(f"--replicates {replicates}: random estimators need at least 2 replicates for a variance")
        num_samples = parse_int_list("--samples", samples)
        memory = parse_bytes(max_memory)
        buckets = _parse_position_buckets(position_buckets)
        config = SweepConfig(
            estimators=estimators, num_samples=num_samples, replicates=replicates, seed=seed, backend=backend,
            device=device, dtype=dtype, max_memory=memory, layers=parse_int_list("--layers", layers),
            heads=parse_int_list("--heads", heads), images=parse_int_list("--images", images),
            probabilities=probabilities, diagnostics=diagnostics, check_reference=check_reference,
            threads=threads, mask=mask, position_buckets=buckets,
        )
        config = with_threads(config)
    except (ValueError, TypeError) as exc:
        abort(str(exc).replace("device=", "--device ").replace("check_reference", "--check-reference"))
    try:
        count_cells(activations, config)  # validates the selection and refuses estimators the masks exclude
    except (ValueError, TypeError) as exc:
        message = str(exc)
        if mask_choice == "file" and mask is not None and "mask" in message:
            message += (" (the mask is the activation file's own metadata 'mask'; --mask none or --mask causal "
                        "overrides it)")
        abort(message)
    return config, activations


def _resolve_mask(choice: str, activations):
    """``--mask``: None, ``"causal"``, or (``file``) the activation file's recorded masks (canonical form)."""
    from randattn.analysis.masking import masks_of_activations
    from randattn.cli._common import abort

    if choice == "none":
        return None
    if choice == "causal":
        return "causal"
    try:
        return masks_of_activations(activations)
    except ValueError as exc:
        abort(f"--mask file: {exc}")


def _parse_position_buckets(text):
    """``--position-buckets``: None (the default, ``auto``) or what :func:`parse_position_buckets` accepts."""
    from randattn.analysis.positions import parse_position_buckets

    if text is None:
        return "auto"
    try:
        return parse_position_buckets(text)
    except ValueError:
        raise ValueError(f"--position-buckets {text!r}: use log2, none or strictly increasing positive lower edges "
                         "such as 1,2,4,8,64") from None


def _check_out(out: Path, dry_run: bool = False) -> Path:
    """``--out``'s suffix, and that it can be written (checked by writing, except in a dry run, which only looks)."""
    import os

    from randattn.analysis.sweep import OUTPUT_FORMATS
    from randattn.cli._common import abort, writable_output

    if out.suffix.lower() not in OUTPUT_FORMATS:
        abort(f"--out {str(out)!r}: unknown suffix {out.suffix!r}; use one of {', '.join(OUTPUT_FORMATS)}")
    if not dry_run:
        return writable_output(out)
    if out.is_dir():
        abort(f"--out {str(out)!r} is a folder; give a file name")
    folder = next(p for p in [out.parent, *out.parent.parents] if p.exists() or p == Path(p.anchor))
    if not folder.is_dir():
        abort(f"--out {str(out)!r}: {str(folder)!r} is a file, not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        abort(f"--out {str(out)!r}: cannot write to {str(folder)!r} (Permission denied)")
    return out


def _already_complete(out: Path, parts: Path, config, resume: bool, force: bool, dry_run: bool = False) -> bool:
    """Apply the rules for an existing output; True when ``--resume`` finds the same run already finished.

    Nothing finished is replaced without ``--force``: an existing table refuses a plain run;
    ``--resume`` on a finished table of the same settings does nothing, of other settings refuses;
    ``--resume`` with an unreadable manifest refuses, naming it. A dry run applies the same rules
    and changes nothing.
    """
    from randattn.analysis.store import stored_unit_ids
    from randattn.cli._common import abort

    if parts.exists() and not stored_unit_ids(parts) and not resume and not dry_run:
        shutil.rmtree(parts, ignore_errors=True)  # a run stopped before its first unit: nothing to keep
    if force:
        return False
    if stored_unit_ids(parts):
        if not resume:
            abort(f"{str(parts)!r} holds an unfinished run; add --resume to continue it, or --force to start afresh")
        _check_manifest(parts)
    if out.exists():
        if not resume:
            abort(f"{str(out)!r} exists; pass --force to replace it (or --resume to check it is complete)")
        if parts.exists():
            return False  # a finished table beside an unfinished rerun: the parts decide
        stored = _stored_identity(out)
        if stored != json.loads(json.dumps(config.identity())):
            abort(f"{str(out)!r} holds a finished run with different settings; use --force or another --out")
        return True
    return False


def _check_manifest(parts: Path) -> None:
    """Exit 2 when ``parts`` holds finished units whose manifest is missing or damaged, naming it and what is wrong."""
    from randattn.analysis.store import read_manifest, stored_unit_ids
    from randattn.cli._common import abort

    if stored_unit_ids(parts):
        try:
            read_manifest(parts)
        except ValueError as exc:
            abort(f"{exc}; --force starts afresh (its finished units are lost)")


def _drop_empty_parts(parts: Path) -> None:
    """Remove a parts folder that holds no finished unit (only its manifest)."""
    from randattn.analysis.store import stored_unit_ids

    if parts.is_dir() and not stored_unit_ids(parts):
        shutil.rmtree(parts, ignore_errors=True)


def _kept(parts: Path | None, then: str | None = None) -> str:
    """What a failed run kept, to end its message: the parts folder for --resume if it holds a finished unit (and,
    with ``then``, "<then>, continue with: <the resume command>"), else that nothing was kept (and the empty
    folder is removed)."""
    from randattn.analysis.store import stored_unit_ids

    if parts is None:
        return "; nothing was kept (no --out)"
    if stored_unit_ids(parts):
        how = "" if then is None else f"; {then}, continue with: {_resume_command()}"
        return f"; finished units are kept in {parts} for --resume{how}"
    _drop_empty_parts(parts)
    return "; nothing was kept (no unit had finished)"


def _interrupted(exc: BaseException, parts: Path | None, plan, console) -> NoReturn:
    """Say what an interrupted (Ctrl-C, SIGTERM) run kept and how to continue it; exit 128 + the signal."""
    from rich.markup import escape

    from randattn.analysis.plan import total_cells
    from randattn.analysis.store import stored_unit_ids
    from randattn.cli._common import interrupt_exit_code

    stored = stored_unit_ids(parts) if parts is not None else set()
    if not stored:
        if parts is not None:
            _drop_empty_parts(parts)
        why = "no --out" if parts is None else "no unit had finished"
        console.print(f"[bold red]interrupted[/]: nothing was kept ({why})", highlight=False)
    else:
        if plan is not None:
            kept = f"{total_cells([u for u in plan.units if u.uid in stored])} of {plan.cells} cells are"
        else:
            kept = f"{len(stored)} finished unit{'s are' if len(stored) > 1 else ' is'}"
        # soft_wrap: the command stays on one line, whole, for copy and paste
        console.print(f"[bold red]interrupted[/]: {kept} kept in {escape(str(parts))}\ncontinue with:\n  "
                      f"{escape(_resume_command())}", highlight=False, soft_wrap=True)
    raise SystemExit(interrupt_exit_code(exc)) from None


def _stored_identity(out: Path):
    sidecar = out.with_name(out.name + ".meta.json")
    try:
        return json.loads(sidecar.read_text())["config_identity"]
    except (OSError, ValueError, KeyError):
        return None


def _resume_command() -> str:
    argv = [a for a in sys.argv[1:] if a not in ("--overwrite", "--force", "--dry-run")]
    if "--resume" not in argv:
        argv.append("--resume")
    return " ".join(map(_quote, ["randattn", *argv]))


# ------------------------------------------------------------------------------------------------------------ plan
def _plan(activations, config, parts, resume, console, where, *, timing: bool = False):
    """Plan the sweep (:func:`~randattn.analysis.sweep.plan_sweep`: units, memory calibration, ``timing``), print it,
    and refuse (exit 2) one that cannot fit the memory budget. Writes nothing."""
    from randattn.analysis import sweep
    from randattn.cli._common import abort

    try:
        plan = sweep.plan_sweep(activations, config, parts_dir=parts, resume=resume, timing=timing)
    except ValueError as exc:
        abort(str(exc))
    for line in _plan_lines(plan, where, timing):
        console.print(line, highlight=False, soft_wrap=True)
    if plan.refused is not None:
        abort(plan.refused)
    return plan


def _plan_lines(plan, where, timing: bool) -> list[str]:
    """The plan in words: two lines (cells, units, selection; memory), three with the wall time."""
    from randattn.analysis.execute import format_bytes

    config = plan.config
    pairs = sum(len(config.num_samples) if e.needs_samples else 1 for e in config.estimators)
    n_layers, n_heads, n_images = len(plan.layers), len(plan.heads), len(plan.images)
    first = (f"[bold]plan[/]: {plan.cells} cells in {_count(len(plan.units), 'unit')} = {_count(n_layers, 'layer')} x "
             f"{_count(n_heads, 'head')} x {_count(n_images, 'image')} x {pairs} (estimator, S) "
             f"{'pair' if pairs == 1 else 'pairs'}, R = {config.replicates}")
    if len(plan.todo) < len(plan.units):
        first += f"; resuming: {plan.todo_cells} cells left to compute"
    if plan.unreadable:
        first += (f" ({_count(len(plan.unreadable), 'unreadable part')} will be set aside into corrupt/ and "
                  "computed again)")
    budget = format_bytes(config.max_memory)
    if plan.refused is not None:
        memory = (f"[bold]memory[/]: refused before computing: one replicate of one head needs more than --max-memory "
                  f"{budget} (the error says how much)")
    elif not plan.todo:
        memory = "[bold]memory[/]: nothing left to compute"
    else:
        memory = (f"[bold]memory[/]: the estimator work peaks at about {format_bytes(plan.peak_bytes)} "
                  f"(memory model, calibrated here; --max-memory {budget}); ")
        if plan.split_units:
            memory += (f"{plan.split_units} of {len(plan.todo)} units are split into smaller blocks to fit it "
                       "(their rows may differ in the last bit from a run with more memory)")
        else:
            memory += "every unit runs in its canonical blocks"
    lines = [first, memory]
    if timing and plan.seconds is not None:
        heads = " and ".join(map(str, plan.timed_heads))
        dask = "" if where is None or where.kind == "local" else "; the Dask workers share it"
        lines.append(f"[bold]wall time[/]: about {_duration(plan.seconds)} of computing in this process{dask} "
                     f"(estimated by computing {heads} head{'s' if plan.timed_heads[-1] > 1 else ''} of each "
                     f"estimator and S here, timed, and extrapolated linearly to {n_heads} heads per unit; start-up "
                     "and writing not included)")
    return lines


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.2g} s" if seconds < 10 else f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _dry_run(activations, config, out, resume, force, where) -> None:
    """``--dry-run``: the rules for --out and the plan, with its wall time; nothing is computed for the table and
    nothing is written."""
    from randattn.cli._common import abort, err_console

    parts = None
    if out is None:
        if resume:
            abort("--resume needs --out (the interrupted run's output path)")
    else:
        out = _check_out(out, dry_run=True)
        parts = out.with_name(out.name + ".parts")
        if _already_complete(out, parts, config, resume, force, dry_run=True):
            err_console.print(f"{out} already holds this run, complete; the run would do nothing", highlight=False)
            return
    _plan(activations, config, parts, resume, err_console, where, timing=True)
    target = "" if out is None else f" (it would write {out})"
    err_console.print(f"dry run: nothing was written; the same command without --dry-run runs it{target}",
                      highlight=False, soft_wrap=True)


def _run(activations, config, parts, resume, console, where=None, source=None, plan=None):
    """Run the sweep with a progress bar; returns its :class:`~randattn.analysis.sweep.SweepTables`.

    ``plan``: :func:`_plan`'s, whose memory calibration the sweep reuses. Ctrl-C and SIGTERM propagate
    (the command says what was kept).
    """
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from randattn.analysis import sweep  # looked up at call time: tests replace sweep.run_sweep
    from randattn.analysis.execute import MemoryBudgetError, format_bytes
    from randattn.analysis.store import CorruptPartWarning
    from randattn.cli._common import abort

    total = plan.cells if plan is not None else sweep.count_cells(activations, config)
    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=console,
                  transient=False) as bar:
        task = bar.add_task("mse", total=total)

        def report(p) -> None:
            s = "" if p.num_samples is None else f" S={p.num_samples}"
            bar.update(task, completed=p.done, description=f"layer {p.layer} {p.label}{s}")

        def show(message, category, *args, **kwargs) -> None:  # a part set aside is said at once
            console.print(f"[yellow]warning[/]: {escape(str(message))}", highlight=False, soft_wrap=True)

        try:
            with warnings.catch_warnings(), _client(where, console, config.threads) as client:
                warnings.simplefilter("ignore")  # run_sweep re-issues each distinct warning once; it returns them all
                warnings.simplefilter("always", CorruptPartWarning)
                warnings.showwarning = show
                tables = sweep.run_sweep(source if client is not None else activations, config, parts_dir=parts,
                                         resume=resume, progress=report, lock=False, resume_hint="--resume",
                                         scheduler=client, with_positions=True, calibrated=plan)
        except MemoryBudgetError as exc:
            abort(str(exc))
        except MemoryError as exc:
            # numpy says what did not fit ("Unable to allocate 66.4 GiB for an array with shape ...")
            what = (str(exc).splitlines() or [""])[0] or "an allocation failed"
            abort(f"out of memory ({what}); lower --max-memory (now {format_bytes(config.max_memory)}) so that work "
                  "is split into smaller blocks, or use fewer --samples / --replicates" + _kept(parts))
        except RuntimeError as exc:
            if "memory" in str(exc).lower() and ("allocate" in str(exc).lower() or "out of" in str(exc).lower()):
                abort(f"out of memory ({str(exc).splitlines()[0]}); lower --max-memory (now "
                      f"{format_bytes(config.max_memory)}) or use fewer --samples / --replicates" + _kept(parts))
            raise
        except (FileExistsError, ValueError) as exc:  # bad input found while running (also raised by a Dask unit)
            plain = isinstance(exc, FileExistsError) or str(exc).startswith("cannot resume")
            abort(str(exc) + ("" if plain else _kept(parts)))
    _report_warnings(tables.table.attrs.get("warnings", []), console)
    return tables


@contextlib.contextmanager
def _client(where, console, threads=None):
    """A Dask client for a non-local scheduler (its dashboard address printed), else None."""
    if where is None or where.kind == "local":
        yield None
        return
    from randattn.analysis.executors import dask_client
    from randattn.cli._common import abort

    try:
        manager = dask_client(where, threads=threads)
        client = manager.__enter__()
    except ValueError as exc:
        abort(str(exc))
    try:
        workers = len(client.scheduler_info().get("workers", {}))
        link = getattr(client, "dashboard_link", None)
        console.print(f"Dask: {workers} workers at {client.scheduler.address}"
                      + (f"; dashboard {link}" if link else ""), highlight=False)
        yield client
    except BaseException:
        if not manager.__exit__(*sys.exc_info()):
            raise
    else:
        manager.__exit__(None, None, None)


def _report_warnings(records, console) -> None:
    """One line per distinct warning, with how many units raised it."""
    for r in records:
        units = _count(r["count"], "unit")
        console.print(f"[yellow]warning[/] ({units}, {r['label']}) {r['category']}: {r['message']}",
                      highlight=False, markup=True)


def reference_check_summary(table) -> dict | None:
    """The largest |batched - reference| over the checked units, per dtype, with its ratio to the cell's RMSE."""
    import numpy as np

    checked = table[np.isfinite(table["ref_max_abs_dev"])] if "ref_max_abs_dev" in table else table.iloc[:0]
    if not len(checked):
        return None
    worst = checked.loc[checked["ref_max_abs_dev"].idxmax()]
    ratio = checked["ref_max_abs_dev"] / np.sqrt(checked["mse"].clip(lower=1e-300))
    worst_ratio = checked.loc[ratio.idxmax()]
    return {
        "units_checked": int(len(checked)),
        "max_abs_dev": float(worst["ref_max_abs_dev"]),
        "max_abs_dev_label": str(worst["label"]),
        "max_dev_over_rmse": float(ratio.max()),
        "max_dev_over_rmse_label": str(worst_ratio["label"]),
        "max_dev_over_rmse_dtype": str(worst_ratio["dtype"]),
        "tolerance_dev_over_rmse": REFERENCE_TOLERANCE,
    }


#: a batched result deviating from the reference by more than this fraction of the cell's RMSE is flagged:
#: its rounding would then move the measured MSE by more than ~2 %
REFERENCE_TOLERANCE = 0.01


def _finish(tables, config, activations, out, as_json) -> None:
    from randattn.analysis.sweep import aggregate, positions_path, table_records, write_tables
    from randattn.cli._common import err_console

    table = tables.table
    summary = aggregate(table, seed=config.seed)
    check = reference_check_summary(table)
    if out is not None:
        metadata = _metadata(config, activations, out)
        metadata["warnings"] = table.attrs.get("warnings", [])
        metadata["reference_check"] = check
        metadata["timing"] = table.attrs.get("timing")
        write_tables(tables, out, metadata)
        err_console.print(f"wrote {len(table)} rows to [bold]{out}[/] (metadata: {out.name}.meta.json)", highlight=False)
        if tables.positions is not None:
            err_console.print(f"wrote {len(tables.positions)} per-position rows to [bold]{positions_path(out)}[/]",
                              highlight=False)
    if check is not None:
        flag = check["max_dev_over_rmse"] > REFERENCE_TOLERANCE
        colour = "yellow" if flag else "green"
        err_console.print(
            f"[{colour}]reference check[/]: {_count(check['units_checked'], 'unit')} re-run on the float64 reference; "
            f"largest |batched - reference| = {check['max_abs_dev']:.2e} ({check['max_abs_dev_label']}), at most "
            f"{check['max_dev_over_rmse']:.1e} of a cell's RMSE ({check['max_dev_over_rmse_label']}, "
            f"{check['max_dev_over_rmse_dtype']})"
            + (f" -- above {REFERENCE_TOLERANCE:g}: rerun with --dtype float64" if flag else ""), highlight=False)
    if as_json:
        click.echo(json.dumps(table_records(summary), indent=2))
    else:
        _print_summary(summary)
        if tables.positions is not None and len(tables.positions):
            _print_positions(tables.positions, config.seed)


#: activation-file metadata copied into the table's: what the report names; a language-model capture's fields
#: (architecture, kv_heads, mask, ...) let it add its LM section. Absent fields are stored as None.
_ACTIVATION_FIELDS = ("model", "layers", "heads", "head_dim", "tokens", "images", "scale", "source", "layout",
                      "architecture", "kv_heads", "head_map", "mask", "sliding_window", "weights", "text", "add_bos")


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
        "activations": {k: activations.metadata.get(k) for k in _ACTIVATION_FIELDS},
        "config_identity": config.identity(),
        # the mask every layer was measured under (None: bidirectional; {"<layer>": kind} when they differ)
        "mask": config.mask_json(),
        "columns_doc": "see randattn.analysis.sweep.COLUMNS",
        "output": str(out),
    }


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(str(arg))


def _print_summary(summary) -> None:
    from rich.table import Table

    from randattn.cli._common import out_console

    kinds = sorted(set(summary["mask"].astype(str))) if "mask" in summary else []
    masks = [kind for kind in kinds if kind != "none"]
    several = len(kinds) > 1  # layers under different masks: a row per mask, named
    under = (f" under the {' and '.join(masks)} mask{'s' if len(masks) > 1 else ''}" if masks else "")
    table = Table(title=f"attention MSE{under} (mean over heads, layers, images; 95% bootstrap CI)")
    for name in ("estimator", "S", "tokens", *(["mask"] if several else []), "MSE [CI]", "bias^2", "variance",
                 "CI over"):
        table.add_column(name, justify="left" if name in ("estimator", "mask", "CI over") else "right",
                         no_wrap=name in ("estimator", "MSE [CI]"))
    for row in summary.itertuples(index=False):
        ci = "" if row.mse_lo != row.mse_lo else f" [{row.mse_lo:.3g}, {row.mse_hi:.3g}]"
        table.add_row(row.label, str(row.num_samples), str(row.tokens), *([str(row.mask)] if several else []),
                      f"{row.mse:.4g}{ci}", f"{row.bias_sq:.3g}", f"{row.variance:.3g}", f"{row.ci_over} ({row.units})")
    out_console.print(table)


def _print_positions(positions, seed: int) -> None:
    """MSE by position bucket at the largest S of each estimator: one row per label, one column per bucket."""
    from rich.table import Table

    from randattn.analysis.positions import bucket_text
    from randattn.analysis.sweep import aggregate
    from randattn.cli._common import out_console

    means = aggregate(positions, n_boot=1, seed=seed, by=("position_lo", "position_hi"))
    largest = means.groupby("label")["num_samples"].transform("max")
    means = means[means["num_samples"] == largest]
    buckets = sorted(set(zip(means["position_lo"], means["position_hi"])))
    table = Table(title="MSE by query position (p = n + M - N + 1; mean over heads, layers, images)")
    table.add_column("estimator", no_wrap=True)
    table.add_column("S", justify="right")
    for lo, hi in buckets:
        table.add_column(f"p {bucket_text(lo, hi)}", justify="right")
    for (label, s), group in means.groupby(["label", "num_samples"], sort=False):
        values = {(lo, hi): mse for lo, hi, mse in zip(group["position_lo"], group["position_hi"], group["mse"])}
        table.add_row(str(label), str(s), *(f"{values[b]:.3g}" if b in values else "" for b in buckets))
    out_console.print(table)
