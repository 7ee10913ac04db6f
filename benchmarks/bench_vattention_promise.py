"""Measurement: does vAttention keep its (epsilon, delta) promise where its budget rule states it -- on the softmax
denominator -- and how does that compare with the output, which the promise does not bound?

vAttention's adaptive budget (the paper's denominator-only rule, the official code) sizes the residual sample so
that ``P(|D_hat - D| > epsilon D) <= delta`` per query, to the accuracy of the central limit theorem with the
residual's spread and D estimated from a base sample (``randattn.estimators.vattention.reference.sample_size``).
``randattn mse`` checks the promise on the denominator too (the spec's ``promise_on``, with ``log_denominator``) and
flags a head whose rate is demonstrably above delta; a user reading "verified attention" may expect it of the
output, ``||y_hat_n - y_n|| > epsilon ||y_n||``. This script measures both rates on the same draws, per head:

- ``denominator``: the rate of ``|D_hat / D - 1| > epsilon`` over R replicates x K queries, with ``D`` written out
  here (a logsumexp of the scaled scores over the visible keys) and ``D_hat`` formed here from the package's
  selection weights (``vattention.batched.select``: 0 for exact keys, ``log(c n_s / b)`` for sampled ones);
- ``output``: the rate of the output's relative error above epsilon, both outputs formed here from the same
  scores and weights;
- each with its exact (Clopper-Pearson) 95% interval, and the sample size b: its mean, and the shares of queries
  where the floor b0 (the base sample) or the cap n_s (the residual's size) set it rather than the bound.

Not a test: the rule is a CLT approximation, so its violation rate may sit above delta where the bound, not the
floor, sets b; this prints what it is. Runs on the last K queries of each head of an activation file (the decode
regime, causal), or on synthetic Gaussian queries and keys (``--synthetic``) at two scales of the scores:

    python benchmarks/bench_vattention_promise.py ACTS.safetensors [--layers 0,15] [--heads 0,4,8]
                                                  [--queries 64] [--replicates 100] [--seed 0]
    python benchmarks/bench_vattention_promise.py --synthetic [--replicates 2000]
    python benchmarks/bench_vattention_promise.py --base-sample [--replicates 2000]
"""

from __future__ import annotations

import argparse
from typing import Any, Iterator

import numpy as np
import torch
from rich.console import Console
from rich.table import Table
from scipy.special import logsumexp

from randattn.analysis.relative_error import clopper_pearson
from randattn.estimators.registry import get_spec
from randattn.estimators.vattention import batched

#: replicates drawn and selected at once (an (R, K, M) float64 weight array per chunk: 64 x 8,192 x 25 = 105 MB)
CHUNK = 25


def measure_head(q: np.ndarray, k: np.ndarray, v: np.ndarray, params: dict[str, Any], replicates: int,
                 seed: int) -> dict[str, Any]:
    """Both violation rates and the sample sizes of one head: ``q (K, D)`` the last K queries, scaled; ``k, v``
    every key and value; causal."""
    spec = get_spec("vattention")
    num_q, num_k = q.shape[0], k.shape[0]
    scores = q @ k.T
    visible = np.arange(num_k)[None, :] <= (np.arange(num_q) + num_k - num_q)[:, None]
    log_d = logsumexp(np.where(visible, scores, -np.inf), axis=-1)  # (K,)
    exact_out = np.exp(np.where(visible, scores, -np.inf) - log_d[:, None]) @ v  # (K, Dv)
    epsilon = params["epsilon"]
    denominator, output, sizes, at_floor, at_cap = [], [], [], [], []
    for rng in (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(-(-replicates // CHUNK))):
        draws = spec.draw(q.shape, k.shape, num_samples=1, replicates=CHUNK, rng=rng, mask="causal", **params)
        chosen = batched.select(torch.as_tensor(q), torch.as_tensor(k), draws.to_torch(), mask="causal",
                                **{**params, "scale": 1.0})
        log_w = chosen.log_weights.numpy()  # (C, K, M)
        weighted = np.where(np.isfinite(log_w), scores + log_w, -np.inf)
        log_d_hat = logsumexp(weighted, axis=-1)  # (C, K)
        denominator.append(np.abs(np.expm1(log_d_hat - log_d)) > epsilon)
        estimate = np.exp(weighted - log_d_hat[..., None]) @ v
        output.append(np.linalg.norm(estimate - exact_out, axis=-1) > epsilon * np.linalg.norm(exact_out, axis=-1))
        b = chosen.sample_sizes.numpy()
        residual = visible.sum(-1) - chosen.heavy.numpy().sum(-1)  # n_s per query
        sizes.append(b)
        at_cap.append(b >= residual)
        at_floor.append((np.ceil(chosen.bounds.numpy()) < b) & (b < residual))
    joined = {name: np.concatenate(parts)[:replicates] for name, parts in
              (("denominator", denominator), ("output", output), ("b", sizes), ("floor", at_floor), ("cap", at_cap))}
    trials = joined["denominator"].size
    row = {"trials": trials, "b": float(joined["b"].mean()), "floor": float(joined["floor"].mean()),
           "cap": float(joined["cap"].mean())}
    for name in ("denominator", "output"):
        count = int(joined[name].sum())
        row[name] = (count / trials, *map(float, clopper_pearson(count, trials)))
    return row


def _rate(rate: tuple[float, float, float], delta: float) -> str:
    """``"0.1106 [0.1038, 0.1177] > delta"``: the rate, its interval, and whether the interval lies above delta."""
    return f"{rate[0]:.4f} [{rate[1]:.4f}, {rate[2]:.4f}]" + (" > delta" if rate[1] > delta else "")


def _heads(path: str, layers: list[int] | None, heads: list[int] | None, queries: int
           ) -> Iterator[tuple[str, np.ndarray, np.ndarray, np.ndarray]]:
    """(label, q (K, D) scaled, k (M, D), v (M, Dv)) of each chosen head of the file's first sequence."""
    from randattn.activations.io import load_activations

    acts = load_activations(path)
    for layer in layers if layers is not None else acts.layers:
        for head in heads if heads is not None else range(acts.shape[1]):
            q, k, v = (np.asarray(a[0], dtype=np.float64) for a in acts.layer_qkv(layer, [head], image=0))
            yield f"layer {layer} head {head}", q[-queries:] * acts.scale, k, v


def _synthetic(seed: int) -> Iterator[tuple[str, np.ndarray, np.ndarray, np.ndarray, dict]]:
    """4 decode queries over 4,000 keys, D = Dv = 16, q and k entries N(0, s^2) for two scales s of the scores,
    values N(0, 1) (their average over many keys is near 0, so the output's relative error is large); a small heavy
    set (4 sinks, 8 local, 8 top-k) so that the residual holds nearly every key."""
    rng = np.random.default_rng(seed)
    params = {"sinks": 4, "local": 8, "top_k": 8, "epsilon": 0.05, "delta": 0.1, "base_rate": 0.05}
    for scale in (0.5, 1.0):
        q, k = (scale * rng.standard_normal((n, 16)) for n in (4, 4000))
        yield f"synthetic, q and k entries N(0, {scale}^2)", q * 16**-0.5, k, rng.standard_normal((4000, 16)), params


def _base_sample(seed: int) -> Iterator[tuple[str, np.ndarray, np.ndarray, np.ndarray, dict]]:
    """4 decode queries over 600 keys (D = 8, Dv = 16), scores of spread 1.5, epsilon = 0.1, delta = 0.2, at three
    base samples: ``base_rate=3`` (b0 = 3 draws), the default 0.05 (b0 = 29 of the 588 residual keys) and 0.25. The
    rule plugs the base sample's sigma and D into the bound, so a small base sample often sizes b below the bound
    that the residual's own sigma and D would give, and the rate can exceed delta by a factor."""
    rng = np.random.default_rng(seed)
    directions = rng.standard_normal((4, 8))
    q = 1.5 * np.sqrt(8) * directions / np.linalg.norm(directions, axis=-1, keepdims=True)
    k, v = rng.standard_normal((600, 8)), rng.standard_normal((600, 16))
    for base_rate in (3, 0.05, 0.25):
        params = {"sinks": 4, "local": 4, "top_k": 4, "epsilon": 0.1, "delta": 0.2, "base_rate": base_rate}
        yield f"600 keys, scores of sd 1.5, base_rate={base_rate:g}", q * 8**-0.5, k, v, params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("acts", nargs="?", help="activation file (randattn capture); omit with --synthetic")
    parser.add_argument("--synthetic", action="store_true")
    parser.add_argument("--base-sample", action="store_true",
                        help="synthetic: the same query at three base samples (b0 = 3, 29 and 147 draws)")
    parser.add_argument("--layers", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--heads", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--queries", type=int, default=64, help="the last K queries of each head")
    parser.add_argument("--replicates", type=int, default=None, help="default 100 (file), 2000 (synthetic)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if (args.synthetic or args.base_sample) == (args.acts is not None) or (args.synthetic and args.base_sample):
        parser.error("give one of an activation file, --synthetic and --base-sample")
    spec = get_spec("vattention")
    if args.synthetic or args.base_sample:
        replicates = args.replicates or 2000
        cases = [(label, q, k, v, spec.resolve_params(extra)) for label, q, k, v, extra in
                 (_synthetic if args.synthetic else _base_sample)(args.seed)]
    else:
        replicates = args.replicates or 100
        cases = [(*case, spec.resolve_params({})) for case in _heads(args.acts, args.layers, args.heads,
                                                                      args.queries)]
    table = Table(title=f"vAttention's (epsilon, delta): violation rates over {replicates} replicates x the queries, "
                        "with 95% Clopper-Pearson intervals")
    for column in ("head", "epsilon", "delta", "denominator", "output", "b (mean)", "b at floor", "b at cap"):
        table.add_column(column, justify="left" if column == "head" else "right")
    for i, (label, q, k, v, params) in enumerate(cases):
        row = measure_head(q, k, v, params, replicates, args.seed + i)
        table.add_row(label, f"{params['epsilon']:g}", f"{params['delta']:g}",
                      *(_rate(row[name], params["delta"]) for name in ("denominator", "output")),
                      f"{row['b']:.0f}", f"{row['floor']:.0%}", f"{row['cap']:.0%}")
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
