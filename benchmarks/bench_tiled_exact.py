"""Exact attention by tiles (``softmax.tiled``) against dense float64 softmax and an equal-FLOP GEMM. Prints a
table; not a test.

What is measured, float64, one head, D = Dv = 64, bidirectional and causal, at each N = M:

- **tiled**: :func:`randattn.estimators.softmax.tiled.tiled_attention` with its default tiles (256 queries x 1024 keys)
  (output and log-normaliser), best of ``--repeats`` runs (wall clock);
- **dense**: :func:`randattn.estimators.softmax.batched.estimate` (the N x M scores, ``torch.softmax``, one
  product with V), when its N x M float64 arrays (about 3 N M 8 bytes under the causal mask) fit in
  ``--dense-max-gib``; else "-";
- **GEMM**: float64 matrix products of the tiled form's FLOP count, 2 N M (D + Dv) (halved under the causal
  mask), as ``(1024, D + Dv) @ (D + Dv, M)`` into one reused output, repeated N / 1024 times (N / 2048 causal),
  best of ``--repeats``: the speed of light of this machine for the same arithmetic;
- **peak extra memory**: :func:`randattn.analysis.memory.measure_peak` with ``torch_tensors=True`` (every
  storage an operator returns while the call runs), the inputs' storages registered first and taken off,
  output included; one separate run.

Usage::

    python benchmarks/bench_tiled_exact.py [--sizes 4096,8192,16384] [--repeats 2] [--threads 1] [--dense-max-gib 4]
"""

from __future__ import annotations

import argparse
from typing import Callable

import torch
from bench_causal import _best_time, _peak_extra  # the same timing and memory measurement as causal RFA's

from randattn.estimators.softmax import batched as softmax_batched
from randattn.estimators.softmax.tiled import DEFAULT_KEY_TILE, DEFAULT_QUERY_TILE, tiled_attention

DIM = DIM_V = 64
GEMM_ROWS = 1024
MIB = 2**20


def _gemm(n: int, m: int, causal: bool) -> Callable[[], None]:
    """Matrix products of 2 N M (D + Dv) FLOPs (half under the causal mask), in row blocks of GEMM_ROWS."""
    g = torch.Generator().manual_seed(1)
    a = torch.randn(GEMM_ROWS, DIM + DIM_V, generator=g, dtype=torch.float64)
    b = torch.randn(DIM + DIM_V, m, generator=g, dtype=torch.float64)
    out = torch.empty(GEMM_ROWS, m, dtype=torch.float64)
    blocks = max(1, n // GEMM_ROWS // (2 if causal else 1))

    def run() -> None:
        for _ in range(blocks):
            torch.matmul(a, b, out=out)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4096,8192,16384")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--dense-max-gib", type=float, default=4.0)
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"float64, 1 head, D = Dv = {DIM}, tiles {DEFAULT_QUERY_TILE} x {DEFAULT_KEY_TILE}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); times best of {args.repeats}")
    header = (f"{'N = M':>6} {'mask':>6} | {'tiled s':>8} {'dense s':>8} {'GEMM s':>7} {'tiled/GEMM':>10} | "
              f"{'tiled MiB':>9} {'dense MiB':>9} {'N M 8 MiB':>9}")
    print(header)
    print("-" * len(header))
    for n in sizes:
        g = torch.Generator().manual_seed(n)
        q, k, v = (torch.randn(1, n, w, generator=g, dtype=torch.float64) for w in (DIM, DIM, DIM_V))
        for mask in (None, "causal"):
            causal = mask == "causal"
            tiled_s = _best_time(lambda: tiled_attention(q, k, v, mask=mask), args.repeats)
            tiled_mib = _peak_extra(lambda: tiled_attention(q, k, v, mask=mask), q, k, v) / MIB
            dense_fits = 3 * n * n * 8 <= args.dense_max_gib * 2**30
            if dense_fits:
                dense_s = _best_time(lambda: softmax_batched.estimate(q, k, v, mask=mask), args.repeats)
                dense_mib = _peak_extra(lambda: softmax_batched.estimate(q, k, v, mask=mask), q, k, v) / MIB
                dense_cols = f"{dense_s:8.2f}", f"{dense_mib:9.0f}"
            else:
                dense_cols = f"{'-':>8}", f"{'-':>9}"
            gemm_s = _best_time(_gemm(n, n, causal), args.repeats)
            print(f"{n:>6} {mask or 'none':>6} | {tiled_s:8.2f} {dense_cols[0]} {gemm_s:7.2f} "
                  f"{tiled_s / gemm_s:10.1f} | {tiled_mib:9.1f} {dense_cols[1]} {n * n * 8 / MIB:9.0f}")


if __name__ == "__main__":
    main()
