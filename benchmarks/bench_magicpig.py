"""MagicPIG's sampler on the CPU: hash buckets against the dense comparisons and the projections' GEMM. Prints a
table; not a test.

What is measured, float32, one head, one replicate, D = 64, the paper's K = 10 bits x L = 150 tables (``--tables``
for another L), 4 sinks and 64 local keys, the last 64 queries of M causal keys with a shared offset and a slow drift (each query centres the
keys on the mean of those it sees), at each M:

- **buckets**: :func:`randattn.estimators.magicpig.batched.log_weights` as it runs on the CPU (hash buckets per
  group of 64 queries, the band's pairs compared per query, ``log u`` at the sampled pairs), best of ``--repeats``;
- **dense**: the same call in the form an accelerator runs (every (query, key, table, bit) compared, ``log u`` at
  every candidate), forced on the CPU, when M is at most ``--dense-max-keys``; else "-";
- **GEMM**: the product both forms start from, the K L hash directions against the keys, means and queries,
  ``(K L, D) @ (D, M + 2 N)``: the floor of the work;
- **softmax**: exact attention of the 64 queries over the M keys (:mod:`randattn.estimators.softmax.batched`), the
  estimate a user would compute instead;
- **same**: whether both forms sampled the same keys (their log weights finite at the same pairs).

Usage::

    python benchmarks/bench_magicpig.py [--sizes 8192,32768,131072] [--tables 150] [--repeats 2] [--dense-max-keys 32768]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from bench_causal import _best_time  # the same timing as the other benchmarks

from randattn.estimators.magicpig import batched as magicpig_batched
from randattn.estimators.magicpig import draw
from randattn.estimators.softmax import batched as softmax_batched

DIM, QUERIES, BITS = 64, 64, 10
SELECTION = {"min_collisions": 2, "sinks": 4, "local": 64, "center": "all-keys", "mask": "causal"}


def _inputs(num_keys: int, tables: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, y, hyperplanes)``: keys with a shared offset (as a language model's keys have) plus a slow drift, so the
    mean each query sees moves; queries around half the offset."""
    rng = np.random.default_rng(num_keys)
    offset = rng.normal(scale=0.3, size=DIM)
    drift = 0.5 * np.sin(2 * np.pi * np.arange(num_keys)[:, None] / 4096 + rng.uniform(0, 2 * np.pi, size=DIM))
    y = rng.normal(size=(num_keys, DIM)) + offset + drift
    x = rng.normal(size=(QUERIES, DIM)) + offset / 2
    planes = draw((QUERIES, DIM), (num_keys, DIM), num_samples=tables, replicates=1, rng=rng,
                  hash_bits=BITS)["hyperplanes"]
    return tuple(torch.as_tensor(a, dtype=torch.float32) for a in (x, y, planes))


def _log_weights(x: torch.Tensor, y: torch.Tensor, planes: torch.Tensor, devices: tuple[str, ...]) -> torch.Tensor:
    saved = magicpig_batched.BUCKETED_DEVICES
    magicpig_batched.BUCKETED_DEVICES = devices
    try:
        return magicpig_batched.log_weights(x, y, planes, **SELECTION)
    finally:
        magicpig_batched.BUCKETED_DEVICES = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8192,32768,131072")
    parser.add_argument("--tables", type=int, default=150, help="L, the hash tables (default: 150)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dense-max-keys", type=int, default=32768)
    args = parser.parse_args()
    print(f"float32, 1 head, 1 replicate, D = {DIM}, K = {BITS}, L = {args.tables}, the last {QUERIES} of M causal keys, "
          f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); times best of {args.repeats}")
    header = (f"{'M':>7} | {'buckets s':>9} {'dense s':>8} {'GEMM s':>7} {'softmax s':>9} | {'buckets/GEMM':>12} "
              f"{'dense/buckets':>13} {'buckets/softmax':>15} | {'keys read':>9} {'same':>4}")
    print(header)
    print("-" * len(header))
    for num_keys in (int(s) for s in args.sizes.split(",")):
        x, y, planes = _inputs(num_keys, args.tables)
        directions = planes[0].transpose(0, 1).reshape(BITS * args.tables, DIM)
        stacked = torch.cat([y, x, x]).T.contiguous()
        buckets_s = _best_time(lambda: _log_weights(x, y, planes, ("cpu",)), args.repeats)
        gemm_s = _best_time(lambda: directions @ stacked, args.repeats)
        v = torch.zeros(num_keys, 1)
        softmax_s = _best_time(lambda: softmax_batched.estimate(x, y, v, mask="causal"), args.repeats)
        in_buckets = _log_weights(x, y, planes, ("cpu",))
        keys_read = torch.isfinite(in_buckets).sum(-1).double().mean().item()
        if num_keys <= args.dense_max_keys:
            dense_s = _best_time(lambda: _log_weights(x, y, planes, ()), args.repeats)
            same = torch.equal(torch.isfinite(in_buckets), torch.isfinite(_log_weights(x, y, planes, ())))
            dense_cols = f"{dense_s:8.2f}", f"{dense_s / buckets_s:13.1f}", "yes" if same else "NO"
        else:
            dense_cols = f"{'-':>8}", f"{'-':>13}", "-"
        print(f"{num_keys:>7} | {buckets_s:9.2f} {dense_cols[0]} {gemm_s:7.3f} {softmax_s:9.3f} | "
              f"{buckets_s / gemm_s:12.1f} {dense_cols[1]} {buckets_s / softmax_s:15.1f} | {keys_read:9.0f} "
              f"{dense_cols[2]:>4}")


if __name__ == "__main__":
    main()
