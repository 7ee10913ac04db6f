"""Benchmark W2 (issue 30): a whole-LM measurement with the default ``randattn mse`` command under the causal mask.

W2 = SmolLM2-135M-Instruct (bundled, GGUF) on its default text (pydoc topics 'assignment' and 'function': 2 texts
x 512 tokens), all 30 layers x 9 query heads (3 key/value heads), the file's causal mask (``--mask file``, the
default); ``-e rfa:coupling=orthogonal -e eva`` at S = 16, 32, 64, 128 and ``-e ra`` at S = 1, R = 32,
probabilities and diagnostics on (the defaults). Each estimator group is one ``randattn mse`` process, run as a
user would; wall time and peak RSS are measured per process. Goal: <= 5 min and <= 1.5x the floor.

``--layers 0,15`` runs a fraction of the layers and extrapolates to 30 as ``bench_sweep.py`` does: a process's
time running its units (``timing.execute_s``) scales with the number of layers; the rest is paid once.

The floor is measured in the same run, as in ``bench_sweep.py``: per (estimator, S), a GEMM with the FLOPs one
cell needs (:func:`_flops`: under the causal mask every N x M product only needs its lower triangle, so those
terms are halved), times the number of cells; the ratio is the (extrapolated) wall time over that floor.

    python benchmarks/bench_w2.py [--layers 0-29] [--replicates 32] [--workdir bench-w2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from bench_sweep import _LAUNCH, _gemm_seconds, _run  # the same GEMM floor, launcher and measurement as W1

LAYERS_TOTAL = 30
HEAD_DIM = 64
GROUPS = {
    "main": (["-e", "rfa:coupling=orthogonal", "-e", "eva"], "16,32,64,128"),
    "ra": (["-e", "ra"], "1"),
}
#: EVA's exact local window on a sequence (its default; a causal window sees at most this many keys)
WINDOW = 49


def _flops(name: str, n: int, s: int, d: int, probabilities: bool) -> float:
    """Multiply-add FLOPs (x2) one replicate of one cell needs under the causal mask, N = M, Dv = D.

    Linear-cost terms (feature maps, prefix sums) are as without a mask; the N x M terms (RA's logits, EVA's
    chunk weights, the probability pass) only need the m <= n half.
    """
    m, dv = n, d
    if name == "rfa":
        est = 2 * (n + m) * s * d + 2 * m * s * dv + 2 * n * s * dv
        prob = n * s * m
    elif name == "eva":
        est = 2 * n * WINDOW * (d + dv) + 2 * m * s * (d + dv) + n * m * d + 2 * n * s * dv
        prob = n * (WINDOW + s) * m
    elif name == "ra":
        est = n * s * m * (d + dv)
        prob = n * s * m * d
    else:
        return float("nan")
    return float(est + (prob if probabilities else 0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="0-29", help="layers to run (the wall time is extrapolated to 30)")
    parser.add_argument("--replicates", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--workdir", default="bench-w2")
    args = parser.parse_args()
    import pandas as pd
    from rich.console import Console
    from rich.table import Table

    from randattn.cli._parsing import parse_int_list

    console = Console(width=None if sys.stdout.isatty() else 200)
    work = Path(args.workdir)
    work.mkdir(exist_ok=True)
    layers = parse_int_list("--layers", args.layers)
    randattn = [sys.executable, "-c", _LAUNCH]
    path = work / f"smollm2-{args.max_tokens}.safetensors"
    if not path.exists():  # the capture is W2's input, not part of the measurement
        subprocess.run([*randattn, "capture", "--model", "smollm2-135m", "--max-tokens", str(args.max_tokens),
                        "--out", str(path)], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    runs, tables = [], []
    total_wall = extrapolated = 0.0
    for group, (estimators, samples) in GROUPS.items():
        out = work / f"w2-{group}.parquet"
        cmd = [*randattn, "mse", str(path), *estimators, "--samples", samples, "--replicates", str(args.replicates),
               "--layers", args.layers, "--out", str(out), "--overwrite"]
        wall, peak, cpu = _run(cmd)
        timing = json.loads(out.with_name(out.name + ".meta.json").read_text())["timing"]
        unit_s = float(timing["execute_s"])
        total_wall += wall
        scaled = (wall - unit_s) + unit_s * LAYERS_TOTAL / len(layers)
        extrapolated += scaled
        runs.append({"group": group, "wall_s": wall, "peak_gib": peak, "units_s": unit_s, "cpu_s": cpu,
                     "extrapolated_s": scaled})
        console.print(f"{group}: {wall:.1f} s ({unit_s:.1f} s in units, {cpu:.0f} CPU s), peak RSS {peak:.2f} GiB"
                      f" -> {scaled:.0f} s for {LAYERS_TOTAL} layers", highlight=False)
        tables.append(pd.read_parquet(out))
    table = pd.concat(tables, ignore_index=True)
    scale_cells = LAYERS_TOTAL / len(layers)
    report = Table(title=f"W2 per configuration: one cell (R = {args.replicates}) vs an equal-FLOP GEMM")
    for col in ("estimator", "S", "dtype", "cells (30 layers)", "GFLOP/cell", "GEMM s/cell", "floor s"):
        report.add_column(col, justify="left" if col == "estimator" else "right")
    floor = 0.0
    summary = []
    for (label, s, dtype), frame in table.groupby(["label", "num_samples", "dtype"], sort=False):
        name = frame["estimator"].iloc[0]
        reps, tokens = int(frame["replicates"].iloc[0]), int(frame["tokens"].iloc[0])
        cells = len(frame) * scale_cells
        flops = reps * _flops(name, tokens, int(s), HEAD_DIM, True)
        gemm = _gemm_seconds(flops, dtype)
        floor += gemm * cells
        summary.append({"label": label, "S": int(s), "dtype": dtype, "cells": cells, "gflop": flops / 1e9,
                        "gemm_s": gemm, "floor_s": gemm * cells})
        report.add_row(label, str(s), dtype, f"{cells:.0f}", f"{flops / 1e9:.3f}", f"{gemm:.4f}", f"{gemm * cells:.1f}")
    console.print(report)
    peak = max(r["peak_gib"] for r in runs)
    console.print(f"\nW2: {total_wall:.0f} s wall for {len(layers)} of {LAYERS_TOTAL} layers -> {extrapolated:.0f} s "
                  f"({extrapolated / 60:.1f} min) for all {LAYERS_TOTAL}; peak RSS {peak:.2f} GiB; "
                  f"GEMM floor {floor:.0f} s; wall / floor {extrapolated / floor:.2f}x "
                  f"(goal <= 300 s and <= 1.5x)", highlight=False)
    (work / "bench_w2.json").write_text(json.dumps({"runs": runs, "layers": list(layers), "wall_s": total_wall,
                                                    "extrapolated_s": extrapolated, "floor_s": floor,
                                                    "ratio": extrapolated / floor, "peak_gib": peak,
                                                    "configs": summary}, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
