"""Causal RFA (unidirectional Performer / FAVOR+): randattn's chunked prefix sums against an equal-FLOP matrix
product and performer-pytorch 1.1.4's ``causal_linear_attention_noncuda``, with the same omegas. Prints tables;
not a test.

What is measured, float32, 1 x 6 heads, D = Dv = 64, S = 256 positive features:

- **ours**: :func:`randattn.estimators.rfa.causal.causal_estimate` (features included), best of 5 runs (wall clock
  on the CPU; CUDA events, after a synchronisation, on a GPU);
- **GEMM**: one ``torch.matmul`` of the prefix-sum algorithm's FLOP count, ``H * (2 N S D * 2 + 2 * 2 N S Dv)``
  (query and key feature products, then the value sums and the queries' products with them), as
  ``(H, N, 2D) @ (H, 2D, 2S)`` (equal when D = Dv), best of 5 runs;
- **peer**: ``softmax_kernel`` (its ``eps=1e-4``) for q' and k' from the same omega matrix, then
  ``causal_linear_attention_noncuda`` (its ``eps=1e-6``), under ``torch.no_grad()``; one run per size (it takes
  minutes at N = 16384 on 2 cores), its memory measured in the same run; on a GPU best of 3 after a warm-up;
- **peak extra memory**: :func:`randattn.analysis.memory.measure_peak` with ``torch_tensors=True`` (every storage an
  operator returns while the call runs), the inputs' storages registered first and taken off, output included; on a
  GPU ``torch.cuda.max_memory_allocated`` above what was allocated before the call;
- **future-invariant**: the keys and values after position N/2 replaced by junk (norms x 50, values x 1e3) leave
  the outputs of queries 0..N/2-1 bit-identical;
- **accuracy** on a real head: a DINOv2 capture (``randattn capture --layers 3 --size 196``), the head with the
  largest key norms, taken as causal; max abs error and RMSE against randattn's float64 causal reference with the
  same omegas (numerical error of each implementation; the Monte Carlo error of the estimator itself is the same
  for both and is reported against exact causal softmax for scale).

Usage::

    python benchmarks/bench_causal.py [--sizes 1024,4096,16384] [--chunk-size 64] [--activations /tmp/acts.safetensors]
                                      [--device cuda] [--json rows.json]

The GPU goal (issue 38): ours <= 0.5x the peer's time at N >= 16,384; ``--device cuda --sizes 4096,16384,65536``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from typing import Callable

import numpy as np
import torch

from randattn.analysis.memory import measure_peak
from randattn.estimators.base import Draws
from randattn.estimators.rfa import reference as rfa_reference
from randattn.estimators.rfa.causal import causal_estimate
from randattn.estimators.snis.prefix import DEFAULT_CHUNK_SIZE
from randattn.estimators.softmax import reference as softmax_reference

HEADS, DIM, SAMPLES = 6, 64, 256
MIB = 2**20


def _best_time(func: Callable[[], object], repeats: int = 5, device: str = "cpu") -> float:
    func()  # warm-up
    times = []
    for _ in range(repeats):
        times.append(_seconds(func, device))
    return min(times)


def _seconds(func: Callable[[], object], device: str) -> float:
    """One call's time: wall clock on the CPU, CUDA events on a GPU (kernels run asynchronously)."""
    if not device.startswith("cuda"):
        start = time.perf_counter()
        func()
        return time.perf_counter() - start
    torch.cuda.synchronize(device)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    func()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / 1e3


def _peak_extra(func: Callable[[], object], *inputs: torch.Tensor) -> int:
    """Peak bytes the call allocates beyond its inputs (its output included).

    :func:`~randattn.analysis.memory.measure_peak` counts a storage the first time an operator returns it, so a
    view of an input would count the input; viewing every input first registers them, and their bytes are taken
    off again. On a GPU the caching allocator's own count is exact: its peak above what was allocated before.
    """
    if inputs[0].is_cuda:
        device = inputs[0].device
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        func()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    storages = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in inputs}

    def run():
        for t in inputs:
            t.view(t.shape)
        func()

    return measure_peak(run, torch_tensors=True) - sum(storages.values())


def _peer():
    """performer-pytorch's (softmax_kernel, causal_linear_attention_noncuda), or None when it is not installed."""
    try:
        from performer_pytorch.performer_pytorch import causal_linear_attention_noncuda, softmax_kernel
    except ImportError:
        return None
    return softmax_kernel, causal_linear_attention_noncuda


def _peer_attention(peer, q, k, v, omega):
    softmax_kernel, causal_linear = peer
    with torch.no_grad():
        q_prime = softmax_kernel(q, projection_matrix=omega, is_query=True)
        k_prime = softmax_kernel(k, projection_matrix=omega, is_query=False)
        return causal_linear(q_prime, k_prime, v)


def _ours(q, k, v, draws, chunk):
    with torch.no_grad():
        return causal_estimate(q, k, v, draws, chunk_size=chunk)[0]


def _inputs(n: int, seed: int, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)  # drawn on the CPU: the same numbers on every device
    return [torch.randn(1, HEADS, n, DIM, generator=gen).to(device) for _ in range(3)]


def _junk_after_half(k, v, seed: int):
    gen = torch.Generator().manual_seed(seed)
    k2, v2 = k.clone(), v.clone()
    half = k.shape[-2] // 2
    k2[..., half:, :] = (torch.randn(k2[..., half:, :].shape, generator=gen) * 50).to(k.device)
    v2[..., half:, :] = (torch.randn(v2[..., half:, :].shape, generator=gen) * 1e3).to(v.device)
    return k2, v2, half


def _performance(sizes, chunk, omega, draws, peer, device="cpu"):
    rows = []
    cuda = device.startswith("cuda")
    for n in sizes:
        q, k, v = _inputs(n, seed=n, device=device)
        ours_time = _best_time(lambda: _ours(q, k, v, draws, chunk), device=device)
        ours_peak = _peak_extra(lambda: _ours(q, k, v, draws, chunk), q, k, v, draws["omega"])
        a = torch.randn(HEADS, n, 2 * DIM, device=device)
        b = torch.randn(HEADS, 2 * DIM, 2 * SAMPLES, device=device)
        gemm_time = _best_time(lambda: torch.matmul(a, b), device=device)
        flops = HEADS * (2 * n * SAMPLES * DIM * 2 + 2 * 2 * n * SAMPLES * DIM)
        k2, v2, half = _junk_after_half(k, v, seed=n + 1)
        out, out2 = _ours(q, k, v, draws, chunk), _ours(q, k2, v2, draws, chunk)
        ours_invariant = bool(torch.equal(out[..., :half, :], out2[..., :half, :]))
        row = dict(n=n, ours=ours_time, ours_peak=ours_peak, gemm=gemm_time, gflops=flops / gemm_time / 1e9,
                   ours_invariant=ours_invariant, peer=math.nan, peer_peak=math.nan, peer_invariant=None)
        if peer is not None:
            timing = {}

            def timed_peer():
                timing["seconds"] = _seconds(lambda: _peer_attention(peer, q, k, v, omega), device)

            row["peer_peak"] = _peak_extra(timed_peer, q, k, v, omega)
            row["peer"] = timing["seconds"]
            if cuda:  # seconds there: the best of 3 after the run above, as ours is timed
                row["peer"] = _best_time(lambda: _peer_attention(peer, q, k, v, omega), repeats=3, device=device)
            if cuda or n <= 4096:  # the peer's invariance needs a second run: minutes at N = 16384 on 2 cores
                p1 = _peer_attention(peer, q, k, v, omega)
                p2 = _peer_attention(peer, q, k2, v2, omega)
                row["peer_invariant"] = bool(torch.equal(p1[..., :half, :], p2[..., :half, :]))
        rows.append(row)
        print(f"  N = {n}: done", file=sys.stderr, flush=True)
    return rows


def _real_head(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q, k, v) float64 of the capture's first layer, image 0, the head whose keys have the largest mean norm."""
    import safetensors.numpy

    tensors = safetensors.numpy.load_file(path)
    layer = sorted({key.rsplit(".", 1)[0] for key in tensors})[0]
    q, k, v = (tensors[f"{layer}.{part}"][0].astype(np.float64) for part in ("q", "k", "v"))
    head = int(np.argmax(np.linalg.norm(k, axis=-1).mean(-1)))
    return q[head], k[head], v[head]


def _omega(dim: int) -> np.ndarray:
    """The S x D Gaussian projection both implementations use (seed 0)."""
    return np.random.default_rng(0).standard_normal((SAMPLES, dim))


def _accuracy(path: str, chunk: int, peer, device: str = "cpu") -> list[str]:
    """Max abs error and RMSE of ours and the peer against the float64 causal reference, on one real head."""
    q, k, v = _real_head(path)
    omega = _omega(q.shape[-1])
    norms = np.linalg.norm(k, axis=-1)
    reference = rfa_reference.estimate(q, k, v, Draws({"omega": omega[None]}, 1), mask="causal")[0]  # literal sums
    exact = softmax_reference.estimate(q, k, v, mask="causal")
    t = lambda a: torch.as_tensor(a, dtype=torch.float32, device=device)  # noqa: E731
    results = {"ours (float32)": _ours(t(q), t(k), t(v), Draws({"omega": t(omega)[None]}, 1), chunk)
               .double().cpu().numpy()}
    if peer is not None:
        results["peer (float32)"] = _peer_attention(peer, t(q)[None, None], t(k)[None, None], t(v)[None, None],
                                                    t(omega))[0, 0].double().cpu().numpy()
    lines = [f"accuracy on a real head ({path}: N = {q.shape[-2]}, key norms {norms.min():.0f}-{norms.max():.0f}), "
             f"causal, S = {SAMPLES}, against randattn's float64 causal reference with the same omegas:"]
    for name, out in results.items():
        err = out - reference
        lines.append(f"  {name:15s} max abs error {np.nanmax(np.abs(err)):.3e}   RMSE {np.sqrt(np.nanmean(err**2)):.3e}"
                     f"   all finite: {bool(np.isfinite(out).all())}")
    err = reference - exact
    lines.append(f"  for scale, the estimator's own error (float64 reference vs exact causal softmax): max abs "
                 f"{np.abs(err).max():.3e}, RMSE {np.sqrt(np.mean(err**2)):.3e}; max |v| {np.abs(v).max():.2f}")
    return lines


def _table(rows, chunk, device="cpu"):
    def mib(b):
        return "-" if isinstance(b, float) and math.isnan(b) else f"{b / MIB:8.1f}"

    def sec(s):
        return "      -" if math.isnan(s) else f"{s:7.3f}"

    header = (f"{'N':>6} | {'ours s':>7} {'GEMM s':>7} {'peer s':>7} | {'ours/peer':>9} {'ours/GEMM':>9} | "
              f"{'ours MiB':>8} {'peer MiB':>8} | {'future-invariant ours/peer':>26}")
    where = (torch.cuda.get_device_name(device) if device.startswith("cuda")
             else f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs")
    lines = [f"causal RFA, float32, 1 x {HEADS} heads, D = Dv = {DIM}, S = {SAMPLES}, chunk {chunk}; "
             f"torch {torch.__version__}, {where}", header,
             "-" * len(header)]
    for r in rows:
        peer_inv = "-" if r["peer_invariant"] is None else ("yes" if r["peer_invariant"] else "NO")
        lines.append(
            f"{r['n']:>6} | {sec(r['ours'])} {sec(r['gemm'])} {sec(r['peer'])} | {r['ours'] / r['peer']:9.3f} "
            f"{r['ours'] / r['gemm']:9.2f} | {mib(r['ours_peak'])} {mib(r['peer_peak'])} | "
            f"{('yes' if r['ours_invariant'] else 'NO') + ' / ' + peer_inv:>26}")
    by_n = {r["n"]: r for r in rows}
    if 4096 in by_n and 16384 in by_n:
        lines.append(f"time growth N 4096 -> 16384: ours {by_n[16384]['ours'] / by_n[4096]['ours']:.2f}x, "
                     f"GEMM {by_n[16384]['gemm'] / by_n[4096]['gemm']:.2f}x, "
                     f"peer {by_n[16384]['peer'] / by_n[4096]['peer']:.2f}x")
    lines.append("GEMM: the equal-FLOP matrix product, its rate in GFLOP/s: "
                 + ", ".join(f"N={r['n']}: {r['gflops']:.1f}" for r in rows))
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1024,4096,16384")
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE)
    parser.add_argument("--activations", default="/tmp/acts.safetensors",
                        help="a capture to take the real head from (made with `randattn capture --layers 3 --size 196` "
                             "when missing)")
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument("--device", default="cpu", help="torch device of every method (cpu, cuda)")
    parser.add_argument("--json", default=None, help="also write the table's rows and the accuracy lines here")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for every method (default: torch's own); 1 gives stable ratios on a "
                             "machine other jobs share, where each of the many small operators otherwise waits "
                             "for the second thread")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    peer = None if args.skip_peer else _peer()
    if peer is None and not args.skip_peer:
        print("performer-pytorch is not installed (pip install --no-deps performer-pytorch==1.1.4 einops "
              "local-attention==1.4.4 axial-positional-embedding==0.2.1): peer columns left empty", file=sys.stderr)
    omega = _omega(DIM)
    omega_t = torch.as_tensor(omega, dtype=torch.float32, device=args.device)
    # one omega matrix for every head, as the peer's projection_matrix is shared by its heads
    draws = Draws({"omega": omega_t.expand(1, 1, HEADS, SAMPLES, DIM)}, 1)
    start = time.perf_counter()
    rows = _performance(sizes, args.chunk_size, omega_t, draws, peer, device=args.device)
    for line in _table(rows, args.chunk_size, device=args.device):
        print(line)
    if not os.path.exists(args.activations):
        subprocess.run(["randattn", "capture", "--layers", "3", "--size", "196", "--out", args.activations],
                       check=True, capture_output=True)
    accuracy = _accuracy(args.activations, args.chunk_size, peer, device=args.device)
    for line in accuracy:
        print(line)
    if args.json is not None:
        with open(args.json, "w") as file:
            json.dump({"device": args.device, "torch": torch.__version__, "chunk_size": args.chunk_size,
                       "rows": [{key: (None if isinstance(val, float) and math.isnan(val) else val)
                                 for key, val in row.items()} for row in rows],
                       "accuracy": accuracy}, file, indent=1)
    print(f"benchmark wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
