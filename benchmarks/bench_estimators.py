"""Benchmark: batched estimators (torch float32) against a batched GEMM of the same FLOP count,
and RFA against performer-pytorch's ``FastAttention``, measured side by side in one run.

Setting (issue #9 target 4): float32, D = Dv = 64, 6 heads, N = M in {785, 3137, 12545},
S in {64, 256}. For every case it prints the batched time, the time of one batched matrix
product ``(6, N, 64) @ (6, 64, c)`` doing the estimator's multiply-add count (its floor),
their ratio, and beside RFA the time and ratio of performer-pytorch's ``FastAttention``
with the same number of features (when installed; it is not a dependency of randattn:
``pip install performer-pytorch``). Then the growth factor of each estimator's time from
N = 785 to N = 12545 (linear: 16x in N; the target is <= 17x). ``--reference`` adds the
float64 numpy reference timing (slow at large N).

Not a test: timings are medians of ``--repeats`` interleaved rounds, taken in one process so
that ratios are comparable (``--threads 1`` gives steadier numbers on a shared machine). Run:

    python benchmarks/bench_estimators.py [--quick] [--estimators rfa,lara,eva,ra]
                                          [--sizes 785,3137,12545] [--samples 64,256]
                                          [--repeats 5] [--threads T] [--reference]

RA is quadratic (O(N M S D)); it is timed at N = 785 only unless ``--ra-max-n`` says otherwise
(one call at N = 3137, S = 256 is ~2e12 FLOPs, minutes on two cores).
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

HEADS = 6
D = DV = 64


def _linear_flops(n: int, m: int, s: int, d: int, dv: int) -> float:
    """Feature projections 2(N+M)SD, key sums 2MS Dv, query combination 2NS Dv (+ normalizers)."""
    return 2 * (n + m) * s * d + 2 * m * s * dv + 2 * n * s * dv


def _ra_flops(n: int, m: int, s: int, d: int, dv: int) -> float:
    """Per query and sample: a softmax over M keys of omega.k (2MD) and its value average (2M Dv)."""
    return 2 * n * s * m * (d + dv)


#: benchmark name -> (registry name, params, FLOP model per head)
CASES = {
    "rfa": ("rfa", {}, _linear_flops),
    "rfa-sderf": ("rfa", {"feature_map": "sderf"}, _linear_flops),
    "lara": ("lara", {}, _linear_flops),
    "eva": ("eva", {"chunk_weight": "mean-key"}, _linear_flops),
    "ra": ("ra", {}, _ra_flops),
}


def _interleaved(fns: dict, repeats: int) -> tuple[dict, dict]:
    """Time every function once per round, ``repeats`` rounds: median seconds, and the per-round samples.

    Interleaving puts the estimator and its floor under the same machine load in each round, so the
    median of per-round ratios is steadier than the ratio of medians on a shared machine.
    """
    for fn in fns.values():
        fn()  # warm-up (allocations, lazy imports)
    samples = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in samples.items()}, samples


def _ratio(samples: dict, a: str, b: str) -> float:
    """Median over rounds of time(a) / time(b)."""
    return statistics.median(x / y for x, y in zip(samples[a], samples[b]))


def _gemm_of_flops(flops_per_head: float, n: int):
    """A batched ``(H, N, D) @ (H, D, c)`` float32 product with ``2 N D c ~= flops_per_head`` per head."""
    c = max(1, round(flops_per_head / (2 * n * D)))
    a = torch.randn(HEADS, n, D)
    b = torch.randn(HEADS, D, c)
    return lambda: torch.bmm(a, b)


def _performer(n: int, s: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """performer-pytorch's FastAttention (positive orthogonal features) on the same inputs, or None."""
    try:
        from performer_pytorch import FastAttention
    except ImportError:
        return None
    attention = FastAttention(dim_heads=D, nb_features=s)
    q4, k4, v4 = (t.unsqueeze(0) for t in (q, k, v))  # (1, H, N, D): its (batch, heads, N, D) layout

    def run():
        with torch.no_grad():
            return attention(q4, k4, v4)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N in {785, 3137}, S = 64 only")
    parser.add_argument("--estimators", default="rfa,rfa-sderf,lara,eva,ra")
    parser.add_argument("--sizes", default="785,3137,12545")
    parser.add_argument("--samples", default="64,256")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ra-max-n", type=int, default=785, help="largest N at which the quadratic RA is timed")
    parser.add_argument("--reference", action="store_true", help="also time the float64 numpy reference (slow)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [n for n in args.estimators.split(",") if CASES[n][0] in randattn.list_estimators()]
    sizes = (785, 3137) if args.quick else tuple(int(x) for x in args.sizes.split(","))
    samples = (64,) if args.quick else tuple(int(x) for x in args.samples.split(","))
    rng = np.random.default_rng(0)
    console = Console(width=160)
    inputs = {n: (rng.standard_normal((3, HEADS, n, D)) * np.array([1.5, 1.5, 1.0])[:, None, None, None]) for n in sizes}
    rows = []
    for name in names:
        registry_name, params, flop_model = CASES[name]
        spec = randattn.get_spec(registry_name)
        resolved = spec.resolve_params(params)
        for n in sizes:
            if registry_name == "ra" and n > args.ra_max_n:
                continue
            q, k, v = inputs[n]
            tq, tk, tv = (torch.tensor(a, dtype=torch.float32) for a in (q, k, v))
            for s in samples:
                draws = randattn.draw(registry_name, q.shape, k.shape, num_samples=s, seed=0, **resolved)
                tdraws = draws.to_torch(dtype=torch.float32)
                flops = flop_model(n, n, s, D, DV)
                fns = {"batched": lambda: spec.batched(tq, tk, tv, tdraws, **resolved), "gemm": _gemm_of_flops(flops, n)}
                if name == "rfa":
                    run = _performer(n, s, tq, tk, tv)
                    if run is not None:
                        fns["performer"] = run
                medians, rounds = _interleaved(fns, args.repeats)
                ratios = {"gemm": _ratio(rounds, "batched", "gemm")}
                if "performer" in fns:
                    ratios["performer"] = _ratio(rounds, "batched", "performer")
                    ratios["performer/gemm"] = _ratio(rounds, "performer", "gemm")
                reference = None
                if args.reference:
                    reference = _interleaved({"reference": lambda: spec.reference(q, k, v, draws, **resolved)}, 1)[0]["reference"]
                rows.append((name, n, s, medians, ratios, reference, HEADS * flops))
    table = Table(title=f"batched (torch float32, {torch.get_num_threads()} threads, {HEADS} heads, D = Dv = {D}) "
                        "vs a batched GEMM of equal FLOPs and performer-pytorch FastAttention")
    for col in ("estimator", "N", "S", "GFLOP", "batched ms", "GEMM ms", "batched / GEMM", "performer ms",
                "batched / performer", "performer / GEMM", "reference ms"):
        table.add_column(col, justify="right")
    for name, n, s, medians, ratios, reference, flops in rows:
        performer = medians.get("performer")
        table.add_row(
            name, str(n), str(s), f"{flops / 1e9:.3f}", f"{medians['batched'] * 1e3:.2f}", f"{medians['gemm'] * 1e3:.2f}",
            f"{ratios['gemm']:.2f}x",
            "" if performer is None else f"{performer * 1e3:.2f}",
            "" if performer is None else f"{ratios['performer']:.2f}x",
            "" if performer is None else f"{ratios['performer/gemm']:.2f}x",
            "" if reference is None else f"{reference * 1e3:.1f}",
        )
    console.print(table)
    growth = Table(title=f"time growth from N = {min(sizes)} to N = {max(sizes)} ({max(sizes) / min(sizes):.1f}x tokens)")
    for col in ("estimator", "S", "batched growth", "GEMM growth"):
        growth.add_column(col, justify="right")
    by_key = {(r[0], r[1], r[2]): r for r in rows}
    for name in names:
        for s in samples:
            lo, hi = by_key.get((name, min(sizes), s)), by_key.get((name, max(sizes), s))
            if lo and hi:
                growth.add_row(name, str(s), f"{hi[3]['batched'] / lo[3]['batched']:.1f}x",
                               f"{hi[3]['gemm'] / lo[3]['gemm']:.1f}x")
    console.print(growth)
    console.print(
        "Times are medians over rounds; ratios are medians over rounds of per-round ratios (each round times "
        "every function once, so both sides of a ratio share the machine's load). "
        "batched / GEMM: time relative to one batched matrix product doing the estimator's multiply-add count "
        "(the overhead of exp/logsumexp/softmax and memory traffic). performer: FastAttention(dim_heads=64, "
        "nb_features=S), positive orthogonal features, no log-space normalization."
    )


if __name__ == "__main__":
    main()
