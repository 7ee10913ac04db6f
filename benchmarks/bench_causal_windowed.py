"""Causal EVA and local attention against their own bidirectional cost (issue: "causal EVA and local the same").

Prints, per N, the batched float32 time of each estimator with and without ``mask="causal"`` and their ratio,
measured in one run on the same inputs and draws (best of 3). 1 x 6 heads, D = Dv = 64, S = 64 chunks for EVA,
window 64 (1-D layout). Usage: ``python benchmarks/bench_causal_windowed.py [--threads N]``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import randattn


def best_of(func, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        func()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sizes", default="1024,4096")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"causal vs bidirectional, float32, 1 x 6 heads, D = Dv = 64, window 64, S = 64; torch "
          f"{torch.__version__}, {args.threads} thread(s)")
    print(f"{'estimator':>9} {'N':>6} | {'bidir s':>8} {'causal s':>9} | causal/bidir")
    for n in map(int, args.sizes.split(",")):
        rng = np.random.default_rng(0)
        q, k, v = (torch.as_tensor(rng.standard_normal((6, n, 64)), dtype=torch.float32) for _ in range(3))
        for name, params, samples in (("eva", {"window": 64, "layout": "sequence"}, 64),
                                      ("local", {"window": 64, "layout": "sequence"}, None)):
            spec = randattn.get_spec(name)
            resolved = spec.resolve_params(params)
            draws = spec.draw(q.shape, k.shape, num_samples=samples, replicates=1, rng=np.random.default_rng(1),
                              **resolved).to_torch(dtype=torch.float32)
            with torch.no_grad():
                bidir = best_of(lambda: spec.batched(q, k, v, draws, **resolved))
                causal = best_of(lambda: spec.batched(q, k, v, draws, **resolved, mask="causal"))
            print(f"{name:>9} {n:>6} | {bidir:8.3f} {causal:9.3f} | {causal / bidir:6.2f}")


if __name__ == "__main__":
    main()
