"""``randattn mse``: activations -> bias / variance / MSE table per (image, layer, head, estimator, S).

A thin click layer: the options and their help. They are checked in :mod:`randattn.cli._parsing`; the run on the
terminal (plan, progress bar, Dask client, exit codes) is :mod:`randattn.cli._mse_session`; the output's rules live
in :mod:`randattn.analysis.store` and what is shown is built by :mod:`randattn.reports.console`.
"""

from __future__ import annotations

from pathlib import Path

import click

from randattn.analysis.masking import MASK_CHOICES


def _mask_option(context: click.Context, parameter: click.Parameter, value: str) -> str:
    """``--mask``: one of :data:`~randattn.analysis.masking.MASK_CHOICES`, or ``sliding:W`` with W a positive
    integer; anything else exits 2 naming what is accepted."""
    from randattn.cli._common import abort
    from randattn.estimators.masks import Mask

    if value in MASK_CHOICES:
        return value
    try:
        Mask.parse(value, "--mask")
    except ValueError as exc:  # worded as every other refused value of mse ("error: ..."), not as click's usage
        other = "" if value.startswith("sliding:") else ", or file (the activation file's own masks)"
        abort(f"{exc}{other}")
    return value


@click.command("mse")
@click.argument("acts", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path))
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
@click.option("--max-memory", default=None,
              help="Approximate memory budget of the estimator work, e.g. 2GiB or 500MB (a bare number is bytes; at "
                   "least 16KiB)  [default: half the memory free on the device: MemAvailable on the CPU, or what "
                   "the process's cgroup has left where less; torch.cuda.mem_get_info on a GPU]")
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
              help="Result table: .parquet, .csv or .json (metadata in <out>.meta.json). With several ACTS, one "
                   "table per file: {stem} in --out is replaced by each file's name without its suffix, e.g. "
                   "--out 'w1-{stem}.parquet'.")
@click.option("--threads", type=int, default=None, metavar="N",
              help="torch intra-op threads per process (default: torch's, usually the number of cores); recorded, "
                   "and needed to reproduce a table bit for bit: float32 rounding depends on it.")
@click.option("--scheduler", default="local", show_default=True, metavar="WHERE",
              help="Where units run: local (this process), processes:N (a local Dask cluster of N worker "
                   "processes) or tcp://HOST:PORT (a running Dask scheduler; ACTS must be readable by every worker). "
                   "The table is the same whatever the scheduler.")
@click.option("--mask", "mask_choice", default="file", show_default=True, callback=_mask_option,
              metavar=f"{'|'.join(MASK_CHOICES)}|sliding:W",
              help="Attention mask of every layer: none (bidirectional), causal (key m visible to query n iff "
                   "m <= n + M - N), sliding:W (causal, and the last W of those keys), or file: the activation "
                   "file's own per-layer 'mask' metadata (a language-model capture records it; a file without it "
                   "is bidirectional). Estimators, the exact softmax and the probabilities all apply it; an "
                   "estimator that does not support it is refused by name.")
@click.option("--position-buckets", "position_buckets", default=None, metavar="auto|log2|none|EDGES",
              help="Per-position metrics, by the query's position p = n + M - N + 1 (under the causal mask, the "
                   "number of keys it sees): log2 (1, 2-3, 4-7, ...), none, or lower edges starting at 1 such as "
                   "1,2,4,8,64 (the last bucket runs to M). auto (the default): log2 on masked layers, none "
                   "otherwise. Written to <out stem>.positions<suffix>.")
@click.option("--queries", "queries", default="all", show_default=True, metavar="all|last:K|sample:K",
              help="Which query rows to measure, against every key they see: all; last:K, the last K rows (under "
                   "the causal mask the decode regime: the estimator gets q[..., -K:, :] and the full k, v, and the "
                   "truth and metrics hold K rows, memory O(K M)); sample:K, K rows drawn without replacement from a "
                   "seed derived from --seed (bidirectional layers only). Recorded in the table's 'queries' "
                   "column. Estimators with windows or segments (lara, eva, scatterbrain, local) measure a subset "
                   "only under --mask causal with last:K.")
@click.option("--epsilon", "epsilon", default=None, type=float, metavar="E",
              help="Also report the violation rate P(||y_hat_n - y_n|| / ||y_n|| > E), E in (0, 1), over the "
                   "queries and replicates of each head, with its Clopper-Pearson 95% interval (columns epsilon, "
                   "violation_rate, violation_lo, violation_hi, and the counts violations, trials). An estimator "
                   "that promises (epsilon, delta) is checked against its own epsilon, with or without this "
                   "option, on the quantity its promise bounds (vAttention's: the softmax denominator; column "
                   "violation_of), per head and family-wise over its heads (Holm).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
def command(acts, out, resume, force, dry_run, scheduler, as_json, **options) -> None:
    """Measure bias, variance and MSE of estimators on the activations in ACTS.

    One row per (image, layer, head, estimator, S); summary averaged as LARA app. H.1
    (heads and layers per image, then images) with bootstrap CIs.

    Several ACTS files run one after the other in this process (start-up paid once), each
    exactly as its own run would: its own table (--out with {stem}), metadata, mask and
    scale, lock and --resume. Every file and output is checked before the first is computed.

    \b
    Examples:
      randattn mse acts.safetensors --estimators "rfa;ra" --samples 16,64 --out mse.parquet
      randattn mse acts.safetensors -e rfa:coupling=orthogonal -e ra:variant=biased --json
      randattn mse acts.safetensors --device cuda --out mse.csv --resume
      randattn mse lm.safetensors --mask causal -e rfa -e ra --out causal.parquet
      randattn mse acts.safetensors --samples 16,64,256 --dry-run
      randattn mse lm.safetensors --mask causal --queries last:64 -e ra --epsilon 0.1
      randattn mse acts196.safetensors acts336.safetensors --out 'w1-{stem}.parquet'
    \b
    Exit codes: 0 ok; 1 an unexpected error; 2 bad usage or input (refused before
    computing), no space left to write an output (the message names the file), or
    memory that ran out (it names the allocation and --max-memory); 130 interrupted
    by Ctrl-C (SIGINT), 143 stopped by SIGTERM. After 2 (no space or no memory),
    130 or 143, finished units are kept beside --out and the message gives the
    --resume command that continues the run.
    """
    from randattn._process import retain_freed_memory
    from randattn.cli import _mse_session as session
    from randattn.cli._parsing import prepare

    retain_freed_memory()  # the sweep reuses its large blocks' pages instead of faulting them in again
    outs = session.outputs(acts, out)
    where = session.preflight(outs, scheduler, resume=resume, force=force)
    jobs = session.prepare_jobs(acts, outs, prepare, options)
    session.measure(jobs, where, resume=resume, force=force, dry_run=dry_run, as_json=as_json)
