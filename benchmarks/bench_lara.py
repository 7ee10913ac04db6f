"""Benchmark: batched LARA (float32) against a matrix product of the same FLOP count, in one run.

Issue #9 target 4: D = Dv = 64, 6 heads, N = M in {785, 3137, 12545}, S in {64, 256}; LARA
<= 5x the equal-FLOP GEMM and its time growing <= 17x from N = 785 to N = 12545 (linear).

FLOP model (multiply-adds count 2): the four products LARA cannot avoid, query and key
log-features ``x omega^T``, ``y omega^T`` (2 (N + M) S D), key sums ``softmax_m(...)^T v``
(2 M S Dv) and outputs (2 N S Dv). The floor is one batched float32 product
``(H, N + M, D) @ (H, D, 2 S)`` with exactly that count (D = Dv). Inputs have ViT-like norms
(queries up to 30, keys up to 150, scale 1/8). Not a test: ratios are medians of repeated
timings within one run, LARA and the GEMM timed alternately. Run:

    python benchmarks/bench_lara.py [--quick] [--repeats 5] [--variants default,balance,grid]
    python benchmarks/bench_lara.py --profile   # torch.profiler table of one N = 3137, S = 64 call
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

import randattn
from randattn.estimators.rfa.reference import NonPositiveDenominatorWarning

HEADS, D = 6, 64
#: name -> (params, side of the square patch grid for N = 1 + side^2, or None)
VARIANTS = {
    "default": ({}, False),  # eq34, decoupled (signed) weights
    "balance": ({"weighting": "balance"}, False),
    "official-vit": ({"proposal": "eq35", "beta": 2.0, "alpha_clamp": 1e-8, "noise": "reference-code"}, False),
    "grid": ({}, True),  # 2-D landmarks on the (N - 1) = side x side patch grid after a CLS token
}
SIDES = {785: 28, 3137: 56, 12545: 112}


def _interleaved(fn, floor, repeats: int) -> tuple[float, float, float]:
    """Median seconds of ``fn`` and ``floor`` and the median of their per-repeat ratios.

    The two are timed alternately, so that load from other processes on a shared machine
    affects both alike (the ratio is steadier than either time)."""
    fn(), floor()  # warm-up
    t_fn, t_floor, ratios = [], [], []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        middle = time.perf_counter()
        floor()
        end = time.perf_counter()
        t_fn.append(middle - start)
        t_floor.append(end - middle)
        ratios.append(t_fn[-1] / t_floor[-1])
    return statistics.median(t_fn), statistics.median(t_floor), statistics.median(ratios)


def _vit_like(rng, n):
    def with_norms(norms):
        x = rng.standard_normal((HEADS, n, D))
        return x / np.linalg.norm(x, axis=-1, keepdims=True) * norms[..., None]

    q = with_norms(rng.uniform(1.0, 30.0, (HEADS, n)))
    k_norms = rng.uniform(1.0, 40.0, (HEADS, n))
    k_norms[:, 0] = 150.0
    k = with_norms(k_norms)
    v = rng.standard_normal((HEADS, n, D))
    return (torch.as_tensor(a, dtype=torch.float32) for a in (q, k, v))


def _case(name, n, s, rng):
    params, use_grid = VARIANTS[name]
    params = dict(params)
    if use_grid:
        params.update(grid=(SIDES[n], SIDES[n]), prefix_tokens=1)
    spec = randattn.get_spec("lara")
    q, k, v = _vit_like(rng, n)
    draws = spec.draw(tuple(q.shape), tuple(k.shape), num_samples=s, replicates=1,
                      rng=np.random.default_rng(0), **spec.resolve_params(params)).to_torch(dtype=torch.float32)

    def run():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NonPositiveDenominatorWarning)
            return spec.batched(q, k, v, draws, scale=0.125, **params)

    a = torch.randn(HEADS, 2 * n, D)
    b = torch.randn(HEADS, D, 2 * s)
    return run, lambda: torch.bmm(a, b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N in {785, 3137}, S = 64 only")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--variants", default="default,balance,official-vit,grid")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch intra-op threads (default 1: on a loaded 2-core machine every parallel op waits for a "
             "descheduled worker, which taxes LARA's ~20 ops and not the one GEMM)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    if args.profile:
        run, _ = _case(args.variants.split(",")[0], 3137, 64, rng)
        run()
        with torch.profiler.profile() as prof:
            run()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        return
    sizes = (785, 3137) if args.quick else (785, 3137, 12545)
    samples = (64,) if args.quick else (64, 256)
    table = Table(title=f"batched LARA, float32, {HEADS} heads, D = Dv = {D}, torch threads {torch.get_num_threads()}")
    for col in ("variant", "N", "S", "LARA ms", "GEMM ms", "ratio (median)", f"time / time(N={sizes[0]})"):
        table.add_column(col, justify="right")
    for name in args.variants.split(","):
        first = {}
        for n in sizes:
            for s in samples:
                run, gemm = _case(name, n, s, rng)
                t_lara, t_gemm, ratio = _interleaved(run, gemm, args.repeats)
                first.setdefault(s, t_lara)
                table.add_row(name, str(n), str(s), f"{1e3 * t_lara:.1f}", f"{1e3 * t_gemm:.2f}",
                              f"{ratio:.1f}", f"{t_lara / first[s]:.1f}")
    Console(width=150).print(table)


if __name__ == "__main__":
    main()
