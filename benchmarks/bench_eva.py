"""EVA kernel cost against its floor: a batched GEMM of the same FLOP count, timed in the same run.

Issue #9 target 4: float32, D = Dv = 64, 6 heads, N in {785, 3137, 12545} (ViT-like: one CLS
token + a square patch grid), batched EVA <= 5x the equal-FLOP GEMM and time(12545) /
time(785) <= 17 (linear). Prints one row per (configuration, layout, N): the median time of
EVA, of the GEMM floor, their ratio, and the growth of EVA's time from the smallest N.

FLOPs are counted from the partition itself (no padding): exact part ``2 sum_n |E^n| (D + Dv)``;
key side ``2 sum_g sum_c |P_gc| S (D + Dv)``; query side ``2 N C (S Dv + D)`` (+ ``2 N C S D``
for query features when ``chunk_weight="rfa"`` or S > 1); ``chunk_weight="exact"`` adds
``2 sum_n |chunks of n| D``. The floor multiplies ``(H, N, 64) @ (H, 64, K)`` with K chosen so
that the GEMM has that many FLOPs.

    python benchmarks/bench_eva.py                 # all sizes, linear configurations
    python benchmarks/bench_eva.py --sizes 785,3137 --configs paper-exact
    PYTHONPATH=/path/to/other/tree python benchmarks/bench_eva.py   # same script, another version
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np
import torch

import randattn
from randattn.estimators.eva import batched as eva_batched
from randattn.estimators.eva import partition as eva_partition_module

#: name -> EVA parameters (window 49 = 7x7 in grid layout, C = num_samples chunks)
CONFIGS = {
    "official": {"partition": "reference-code", "chunk_weight": "mean-key"},  # the official code's estimator: linear
    "reference-code-rfa": {"partition": "reference-code", "chunk_weight": "rfa", "samples_per_chunk": 2},
    "paper-mean-key": {"partition": "paper", "chunk_weight": "mean-key"},  # re-chunks per block: O(M^2 / W)
    "paper-exact": {"partition": "paper", "chunk_weight": "exact"},  # the default: eq. 13 weights, O(N M D)
}


def _median_times(fns, repeats: int) -> list[float]:
    """Median wall time of each function, timed in alternation so that a shared machine's load hits all alike."""
    for fn in fns:
        fn()  # warm-up (also fills the partition cache)
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def _flops(n: int, params: dict, num_chunks: int, heads: int, dim: int, dv: int, grid) -> float:
    kwargs = dict(window=49, prefix_tokens=1, num_chunks=num_chunks, partition=params["partition"])
    if grid is not None:
        kwargs["grid"] = grid
    part = eva_partition_module.eva_partition(n, n, **kwargs)
    samples = params.get("samples_per_chunk", 1)
    weight = params["chunk_weight"]
    exact = sum(len(e) for e in part.exact_keys)
    flops = 2.0 * exact * (dim + dv)
    for g in part.groups:
        chunk_keys = sum(len(c) for c in g.chunks)
        n_g, c_g = len(g.queries), len(g.chunks)
        flops += 2.0 * chunk_keys * samples * (dim + dv)
        flops += 2.0 * n_g * c_g * (samples * dv + dim)
        if weight == "rfa" or samples > 1:
            flops += 2.0 * n_g * c_g * samples * dim
        if weight == "exact":
            flops += 2.0 * n_g * chunk_keys * dim
    return flops * heads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="785,3137,12545", help="token counts 1 + s^2")
    parser.add_argument("--configs", default="official,reference-code-rfa", help=f"comma list of {', '.join(CONFIGS)}")
    parser.add_argument("--layouts", default="sequence,grid")
    parser.add_argument("--chunks", type=int, default=49, help="C = num_samples (the official num_landmarks = 49)")
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch intra-op threads for EVA and the floor alike (1: on a shared machine every parallel region "
        "otherwise waits ~20 ms for a descheduled worker, which measures the load rather than the kernel)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dim = dv = 64
    torch.manual_seed(0)
    supports_grid = "layout" in randattn.get_spec("eva").params
    print(f"randattn from {randattn.__file__}; torch {torch.__version__}, {torch.get_num_threads()} threads, float32, "
          f"D = Dv = {dim}, H = {args.heads}, C = {args.chunks}, window 49")
    print(f"{'config':<20} {'layout':<9} {'N':>6} {'GFLOP':>7} {'eva ms':>9} {'gemm ms':>8} {'ratio':>6} {'growth':>7}")
    for name in args.configs.split(","):
        params = CONFIGS[name]
        for layout in args.layouts.split(","):
            if layout == "grid" and not supports_grid:
                print(f"{name:<20} {layout:<9} (this version has no grid layout)")
                continue
            first = None
            for n in map(int, args.sizes.split(",")):
                side = math.isqrt(n - 1)
                grid = (side, side) if layout == "grid" else None
                rng = np.random.default_rng(0)
                q, k, v = (torch.as_tensor(rng.standard_normal((args.heads, n, dim)), dtype=torch.float32) for _ in range(3))
                extra = {"layout": layout, "grid": grid} if supports_grid else {}
                draws = randattn.draw("eva", q.shape, k.shape, num_samples=args.chunks, seed=0, **{
                    key: val for key, val in params.items() if key == "samples_per_chunk"})
                draws = draws.to_torch(dtype=torch.float32)
                run = lambda: eva_batched.estimate(q, k, v, draws, window=49, prefix_tokens=1, **params, **extra)  # noqa: E731
                flops = _flops(n, params, args.chunks, args.heads, dim, dv, grid)
                width = max(1, round(flops / (2.0 * args.heads * n * dim)))
                a = torch.randn(args.heads, n, dim)
                b = torch.randn(args.heads, dim, width)
                with torch.no_grad():
                    t_eva, t_gemm = _median_times([run, lambda: a @ b], args.repeats)
                first = t_eva if first is None else first
                print(f"{name:<20} {layout:<9} {n:>6} {flops / 1e9:>7.2f} {t_eva * 1e3:>9.1f} {t_gemm * 1e3:>8.1f} "
                      f"{t_eva / t_gemm:>6.1f} {t_eva / first:>7.1f}")


if __name__ == "__main__":
    main()
