"""Benchmark W3: long contexts -- SmolLM2-135M at 8,192 tokens, and a synthetic causal scaling series to 32k tokens.

Each measurement is one ``randattn mse`` process run as a user would (``bench_sweep._LAUNCH``): its wall time and
its peak RSS (``VmHWM``), with a per-run timeout. Not a test.

**w3** (``--what w3``): SmolLM2-135M captured on all pydoc topics packed into one 8,192-token text, layers 0, 15, 29
(``randattn capture --model smollm2-135m --text pydoc:all --pack --max-tokens 8192 --layers 0,15,29``; about 140 s
and 1.7 GB, skipped with ``--acts FILE``), then the file's causal mask, ``-e rfa:coupling=orthogonal -e eva
--samples 64 --replicates 8``, all 9 heads, every query. Beside it, in the same run, the matrix-product floor: the
exact attention's GEMMs (``q k^T`` and ``P v``, causal half, every head and layer) and the cells' (``bench_w2._flops``)
timed as plain torch matmuls of equal FLOP count; printed as ratios. Goal: <= 2 GiB peak RSS.

**scaling** (``--what scaling``): synthetic float32 activations, one layer of 3 heads (one grouped-query head group),
D = Dv = 64, causal, ``rfa:coupling=orthogonal`` at S = 64, R = 8, every query, at N = 4,096 ... 32,768 (``--sizes``);
then ``--queries last:64`` at M = ``--decode-tokens``. Time should grow at most as N^2, memory at most as N. Goals:
N = 32,768 in <= 2 GiB; last:64 at M = 131,072 in <= 1 GiB. The probability error of causal RFA has no factors:
its columns cost a K x M product per replicate, as dense, so the series runs with ``--no-probabilities`` unless
``--probabilities`` is given (with it, a budget below one head's K x M probabilities leaves prob_mse NaN).

    python benchmarks/bench_w3.py --what scaling [--sizes 4096,8192,16384,32768] [--timeout 900]
    python benchmarks/bench_w3.py --what w3 [--acts smollm2-8192.safetensors] [--max-memory 2GiB]

On a GPU (``benchmarks/gpu.sh`` runs it): the 16,384-token causal run of 9 heads with Performer and EVA, wall time
and peak GPU memory (goal: <= 15 s and <= 4 GB on an H100):

    python benchmarks/bench_w3.py --what scaling --sizes 16384 --decode-tokens 0 --heads 9 \
        --scaling-estimators "rfa:coupling=orthogonal;eva" --device cuda --max-memory 4GiB
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from bench_sweep import _LAUNCH, _gemm_seconds  # the same launcher and GEMM floor as W1 and W2
from bench_w2 import _flops

HEAD_DIM = 64


def _run(cmd: list[str], timeout: float) -> tuple[float, float, int, float]:
    """Wall seconds, peak RSS (GiB), exit status (``124`` when it ran past ``timeout``) and peak GPU memory (GiB,
    ``torch.cuda.max_memory_allocated``; NaN without a GPU) of one child process."""
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        rss_file, gpu_file = Path(scratch) / "rss-peak-kb", Path(scratch) / "gpu-peak-bytes"
        env = {**os.environ, "RANDATTN_RSS_PEAK": str(rss_file), "RANDATTN_PEAK": str(gpu_file)}
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                                  timeout=timeout)
            code = proc.returncode
            if code != 0:
                print(proc.stderr[-1500:], file=sys.stderr)
        except subprocess.TimeoutExpired:
            code = 124
        wall = time.perf_counter() - t0
        peak = int(rss_file.read_text()) / 2**20 if rss_file.exists() else float("nan")
        gpu = int(gpu_file.read_text()) / 2**30 if gpu_file.exists() else float("nan")
    return wall, peak, code, gpu


def _synthetic(path: Path, n: int, heads: int = 3, seed: int = 0) -> Path:
    """float32 q, k, v ``(1, heads, n, 64)`` of one layer, causal, scale 1/8 (as an LM capture's)."""
    from randattn.activations import make_activations, save_activations

    if path.exists():
        return path
    rng = np.random.default_rng(seed)
    arrays = {0: tuple((0.6 * rng.standard_normal((1, heads, n, HEAD_DIM))).astype(np.float32) for _ in range(3))}
    return save_activations(make_activations(arrays, {"scale": HEAD_DIM ** -0.5, "model": "synthetic",
                                                      "mask": "causal", "layout": "sequence"}), path)


def scaling(args, randattn: list[str], work: Path) -> list[dict]:
    probs = [] if args.probabilities else ["--no-probabilities"]
    estimators = sum((["-e", e] for e in args.scaling_estimators.split(";")), [])
    rows = []
    runs = [(n, "all") for n in args.sizes] + ([(args.decode_tokens, "last:64")] if args.decode_tokens else [])
    for n, queries in runs:
        path = _synthetic(work / f"synthetic-{n}{'' if args.heads == 3 else f'-h{args.heads}'}.safetensors", n,
                          heads=args.heads)
        out = work / f"scaling-{n}-{queries.replace(':', '')}.parquet"
        cmd = [*randattn, "mse", str(path), "--mask", "causal", *estimators, "--samples", "64",
               "--replicates", "8", "--queries", queries, "--max-memory", args.max_memory, "--threads",
               str(args.threads), "--device", args.device, *probs, "--out", str(out), "--overwrite"]
        wall, peak, code, gpu = _run(cmd, args.timeout)
        row = {"N": n, "queries": queries, "wall_s": wall, "peak_gib": peak, "exit": code, "device": args.device,
               "heads": args.heads, "estimators": args.scaling_estimators}
        if args.device != "cpu":
            row["peak_gpu_gib"] = gpu
        rows.append(row)
        on_gpu = f", peak GPU memory {gpu:.3f} GiB" if args.device != "cpu" else ""
        print(f"N = {n:>7} queries {queries:>8}: {wall:8.1f} s, peak RSS {peak:.3f} GiB{on_gpu}, exit {code}",
              flush=True)
    full = [r for r in rows if r["queries"] == "all" and r["exit"] == 0]
    for a, b in zip(full, full[1:]):
        growth = b["N"] / a["N"]
        print(f"N x {growth:g}: time x {b['wall_s'] / a['wall_s']:.2f} (N^2: {growth ** 2:g}), "
              f"RSS x {b['peak_gib'] / a['peak_gib']:.2f} (N: {growth:g})")
    return rows


def w3(args, randattn: list[str], work: Path) -> dict:
    path = Path(args.acts) if args.acts else work / "smollm2-8192.safetensors"
    if not path.exists():  # the capture is W3's input, not part of the measurement
        t0 = time.perf_counter()
        subprocess.run([*randattn, "capture", "--model", "smollm2-135m", "--text", "pydoc:all", "--pack",
                        "--max-tokens", "8192", "--layers", "0,15,29", "--out", str(path)], check=True,
                       stdout=subprocess.DEVNULL)
        print(f"capture: {time.perf_counter() - t0:.0f} s -> {path}")
    import pandas as pd

    out = work / "w3.parquet"
    probs = [] if args.probabilities else ["--no-probabilities"]
    cmd = [*randattn, "mse", str(path), *sum((["-e", e] for e in args.estimators.split(";")), []), "--samples", "64",
           "--replicates", "8", "--max-memory", args.max_memory, "--threads", str(args.threads), *probs,
           "--out", str(out), "--overwrite"]
    wall, peak, code, _ = _run(cmd, args.timeout)
    print(f"W3: {wall:.0f} s wall, peak RSS {peak:.3f} GiB, exit {code} (goal <= 2 GiB)")
    if code != 0:
        return {"wall_s": wall, "peak_gib": peak, "exit": code}
    table = pd.read_parquet(out)
    tokens = int(table["tokens"].iloc[0])
    layers, heads = table["layer"].nunique(), table["head"].nunique()
    # the exact attention: q k^T and P v per head and layer, the causal half
    exact_flops = layers * heads * 2 * 2 * tokens * tokens * HEAD_DIM / 2
    floor = _gemm_seconds(exact_flops, "float64")
    print(f"exact attention GEMM floor ({layers} layers x {heads} heads, float64): {floor:.1f} s")
    for (label, s, dtype), frame in table.groupby(["label", "num_samples", "dtype"], sort=False):
        flops = int(frame["replicates"].iloc[0]) * _flops(frame["estimator"].iloc[0], tokens, int(s), HEAD_DIM,
                                                        args.probabilities) * len(frame)
        gemm = _gemm_seconds(flops, dtype)
        floor += gemm
        print(f"{label} S = {s} ({dtype}): {len(frame)} cells, {flops / 1e9:.1f} GFLOP, GEMM {gemm:.1f} s")
    print(f"W3 floor {floor:.1f} s; wall / floor {wall / floor:.2f}x; peak RSS {peak:.3f} GiB")
    return {"wall_s": wall, "peak_gib": peak, "floor_s": floor, "ratio": wall / floor, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--what", choices=["w3", "scaling"], default="scaling")
    parser.add_argument("--acts", default=None, help="an existing 8,192-token capture (w3)")
    parser.add_argument("--estimators", default="rfa:coupling=orthogonal;eva", help="w3's estimators, ';'-separated")
    parser.add_argument("--sizes", default="4096,8192,16384,32768",
                        type=lambda text: [int(t) for t in text.split(",") if t])
    parser.add_argument("--decode-tokens", type=int, default=131072, help="M of the last:64 run (0: none)")
    parser.add_argument("--max-memory", default="2GiB")
    parser.add_argument("--scaling-estimators", default="rfa:coupling=orthogonal",
                        help="the scaling series' estimators, ';'-separated")
    parser.add_argument("--heads", type=int, default=3, help="the scaling series' heads (one layer)")
    parser.add_argument("--device", default="cpu", help="the scaling series' device (cuda: peak GPU memory too)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--probabilities", action="store_true", help="measure prob_mse too (costly, see above)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per randattn process")
    parser.add_argument("--workdir", default="bench-w3")
    args = parser.parse_args()
    work = Path(args.workdir)
    work.mkdir(exist_ok=True)
    randattn = [sys.executable, "-c", _LAUNCH]
    result = scaling(args, randattn, work) if args.what == "scaling" else w3(args, randattn, work)
    (work / f"bench_w3-{args.what}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
