"""Benchmark: batched (torch) vs reference (numpy float64), and batched vs a plain matrix
product of the same FLOP count, for N in {197, 785, 3137}, D = 64, S in {64, 256}, float32.

Not a test: prints ratios measured in one run (medians of repeated timings), so they are
comparable with each other on this machine. Run:

    python benchmarks/bench_estimators.py [--quick] [--estimators rfa,lara,eva] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

import randattn

#: (estimator, params, flop model in terms of N, M, S, D, Dv) — multiply-adds counted as 2 FLOPs
LINEAR = {
    "rfa": ({}, lambda n, m, s, d, dv: 2 * (n + m) * s * d + 2 * m * s * dv + 2 * n * s * dv),
    "lara": ({}, lambda n, m, s, d, dv: 2 * (n + m) * s * d + 2 * m * s * dv + 2 * n * s * dv),
    "eva": ({"chunk_weight": "mean-key"}, lambda n, m, s, d, dv: 2 * (n + m) * s * d + 2 * m * s * dv + 2 * n * s * dv),
    # the official code's linear layout: chunks shared by every query block
    "eva-shared-chunks": (
        {"chunk_weight": "mean-key", "partition": "reference-code"},
        lambda n, m, s, d, dv: 2 * (n + m) * s * d + 2 * m * s * dv + 2 * n * s * dv,
    ),
}


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up (allocations, lazy imports)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _matmul_of_flops(flops: float, n: int, d: int):
    """A (N, D) @ (D, c) float32 product with 2 N D c ~= flops."""
    c = max(1, round(flops / (2 * n * d)))
    a = torch.randn(n, d)
    b = torch.randn(d, c)
    return lambda: a @ b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N in {197, 785}, S = 64 only")
    parser.add_argument("--estimators", default="rfa,lara,eva,eva-shared-chunks")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    names = [n for n in args.estimators.split(",") if n.split("-")[0] in randattn.list_estimators()]
    sizes = (197, 785) if args.quick else (197, 785, 3137)
    samples = (64,) if args.quick else (64, 256)
    d = dv = 64
    rng = np.random.default_rng(0)
    console = Console(width=150)
    cases = []
    for name in names:
        params, flop_model = LINEAR[name]
        spec = randattn.get_spec(name.split("-")[0])
        resolved = spec.resolve_params(params)
        for n in sizes:
            q, k = rng.standard_normal((2, n, d)) * 1.5
            v = rng.standard_normal((n, dv))
            for s in samples:
                draws = randattn.draw(spec.name, q.shape, k.shape, num_samples=s, seed=0, **resolved)
                cases.append((name, spec, resolved, n, s, (q, k, v), draws, flop_model(n, n, s, d, dv)))
    # all torch timings first, then the numpy references: BLAS threads left spinning by a numpy
    # call would otherwise compete with torch for the two cores and inflate its timings
    timings = {}
    for name, spec, resolved, n, s, (q, k, v), draws, flops in cases:
        tq, tk, tv = (torch.tensor(a, dtype=torch.float32) for a in (q, k, v))
        tdraws = draws.to_torch(dtype=torch.float32)
        batched = _median_seconds(lambda: spec.batched(tq, tk, tv, tdraws, **resolved), args.repeats)
        matmul = _median_seconds(_matmul_of_flops(flops, n, d), args.repeats)
        timings[name, n, s] = [batched, matmul]
    for name, spec, resolved, n, s, (q, k, v), draws, flops in cases:
        timings[name, n, s].append(
            _median_seconds(lambda: spec.reference(q, k, v, draws, **resolved), max(1, args.repeats // 2))
        )
    table = Table(title=f"batched (torch float32, {torch.get_num_threads()} threads) vs reference (numpy float64) and vs matmul of equal FLOPs")
    for col in ("estimator", "N", "S", "batched ms", "reference ms", "reference / batched", "GFLOP", "matmul ms", "batched / matmul"):
        table.add_column(col, justify="right")
    for name, spec, resolved, n, s, _, _, flops in cases:
        batched, matmul, reference = timings[name, n, s]
        table.add_row(
            name, str(n), str(s), f"{batched * 1e3:.2f}", f"{reference * 1e3:.2f}",
            f"{reference / batched:.1f}x", f"{flops / 1e9:.3f}", f"{matmul * 1e3:.3f}", f"{batched / matmul:.1f}x",
        )
    console.print(table)
    console.print(
        "reference / batched > 1: the torch engine is that many times faster than the float64 reference. "
        "batched / matmul: time relative to one BLAS matrix product doing the estimator's multiply-add count "
        "(the overhead of exp/logsumexp/softmax and memory traffic)."
    )


if __name__ == "__main__":
    main()
