"""GPU-readiness without a GPU: the work of a unit does not grow in launches with the replicates R.

ARCHITECTURE §14 ("On a GPU"): a cell should cost a handful of kernel launches whatever R is; replicates are a
batch dimension, never a Python loop. On this CPU machine the proxy for launches is the number of torch operator
calls, counted at torch's dispatcher (each aten call is at most a few kernels on a device; views count too, so the
count bounds the launches from above), and the proxy for host->device traffic is the number of uploads (the
recorder of ``test_unit_transfers``: a tensor made with an explicit ``device=``). Both are counted for one unit of
every built-in estimator -- the draws, the estimates with their implied probabilities, the importance-sampling
diagnostics, the reference spot check and the metrics, as :class:`~randattn.analysis.execute.UnitRunner` runs
them -- at R = 2, 8 and 20, and must be the same at every R: two points could not tell a constant from a slow
growth, and R = 20 lies past the 8 replicates that the diagnostics read (a unit split into blocks of 8 replicates
would show as 3x the calls).

The draws are counted too: one ``draw`` call per unit whatever R, and for orthogonal features one QR per block
shape (the QR of every replicate's Gaussian blocks runs once on their stack). What does grow with R on the host
is inherent and is not a launch: every (replicate, cell) keeps its own numpy generator (a unit's rows depend only
on its id, the seed and the inputs, not on the block split), so :class:`~randattn.analysis.plan.StackedGenerators`
asks R x C generators for their numbers; the numbers are then uploaded once per array per unit.
"""

from __future__ import annotations

import collections
import dataclasses
import warnings

import numpy as np
import pytest
from test_unit_transfers import Transfers, _acts  # the dispatcher recorder of host<->device traffic

from randattn.analysis.execute import UnitRunner
from randattn.analysis.sweep import SweepConfig, parse_estimator_list, plan

R_VALUES = (2, 8, 20)
S = 5
#: every built-in, in configurations that select among the test's 12 keys (Quest with pages of one key: its S = 5 must
#: be whole pages; MagicPIG's default 4 sinks and 64 local keys would hold every key exact and hash nothing)
DECODE_TIME = ("topk", "streaming", "quest:page_size=1", "magicpig:sinks=1,local=1", "vattention")
#: configurations whose operator calls grow with R by design, each with why: their counts must be affine in R
#: (a fixed number of calls per replicate), never faster
PER_REPLICATE = {
    "magicpig:sinks=1,local=1": "MagicPIG hashes one replicate at a time: its (K, M, L) key projections are 786 MB "
                                "per replicate and head at 131,072 keys, K = 10 bits and L = 150 tables (float32)",
}
BIDIRECTIONAL = ("softmax", "rfa", "rfa:coupling=orthogonal", "ra", "lara", "eva", "scatterbrain", "local", *DECODE_TIME)
CAUSAL = ("softmax", "rfa", "rfa:coupling=orthogonal", "ra", "eva", "local", *DECODE_TIME)
CASES = [pytest.param(e, None, id=f"{e}-bidirectional") for e in BIDIRECTIONAL] + [
    pytest.param(e, "causal", id=f"{e}-causal") for e in CAUSAL]


class Launches(Transfers):
    """:class:`Transfers` that also counts every aten operator call (a launch's proxy) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.operators: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.operators[str(func.overloadpacket)] += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


@dataclasses.dataclass(frozen=True)
class UnitCounts:
    operators: collections.Counter
    uploads: int
    draws: int
    qr: int


def _runner(estimator: str, mask: str | None) -> UnitRunner:
    config = SweepConfig(estimators=parse_estimator_list(estimator), num_samples=(S,), replicates=R_VALUES[0], seed=3,
                         backend="torch", probabilities=True, diagnostics=True, khat_queries=2, check_reference=1.0,
                         mask=mask, dtype="auto")
    runner = UnitRunner(_acts(mask), config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runner.run(next(iter(plan(runner.acts, config))))  # the exact attention, cached per image-layer, computed
    return runner


def _unit_counts(runner: UnitRunner, replicates: int, monkeypatch) -> UnitCounts:
    """Operator calls, uploads, ``draw`` calls and QRs of the first unit of ``runner``'s sweep at R = ``replicates``.

    One runner serves every R (its configuration's ``replicates`` replaced): the memory model's calibration, which
    does not depend on R, and the exact attention (cached per image-layer) are computed once, outside the counts,
    as a sweep computes them once for all its units.
    """
    runner.config = dataclasses.replace(runner.config, replicates=replicates)
    unit = next(iter(plan(runner.acts, runner.config)))
    runner.blocks(unit)  # the memory calibration (once per configuration, whatever R) is not the unit's work
    (name,) = runner.specs
    spec = runner.specs[name]
    draws, qr = [], []

    def counting_draw(*args, **kwargs):
        draws.append(1)
        return spec.draw(*args, **kwargs)

    real_qr = np.linalg.qr

    def counting_qr(*args, **kwargs):
        qr.append(1)
        return real_qr(*args, **kwargs)

    monkeypatch.setattr(runner, "specs", {name: dataclasses.replace(spec, draw=counting_draw)})
    monkeypatch.setattr(np.linalg, "qr", counting_qr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # R = 2's NaN jackknife SE, LARA's signed normalizers: facts, not faults
        with Launches() as recorder:
            runner.run_timed(unit)
    monkeypatch.undo()
    uploads = sum(len(sizes) for sizes in recorder.of("in").values())
    return UnitCounts(recorder.operators, uploads, len(draws), len(qr))


@pytest.mark.parametrize(("estimator", "mask"), CASES)
def test_a_units_launches_and_uploads_do_not_grow_with_replicates(estimator, mask, monkeypatch):
    """Operator calls, uploads, draws and QRs the same at every R; operator calls affine in R where declared."""
    runner = _runner(estimator, mask)
    counts = {r: _unit_counts(runner, r, monkeypatch) for r in R_VALUES}
    first = counts[R_VALUES[0]]
    assert sum(first.operators.values()) > 0, "the counter saw no operator call"
    if estimator in PER_REPLICATE:
        totals = [sum(counts[r].operators.values()) for r in R_VALUES]
        slopes = [(totals[i + 1] - totals[i]) / (R_VALUES[i + 1] - R_VALUES[i]) for i in range(len(R_VALUES) - 1)]
        assert slopes[0] > 0 and slopes[0] == slopes[1], (
            f"{estimator}: operator calls {dict(zip(R_VALUES, totals))} are not affine in R ({PER_REPLICATE[estimator]})")
    for r, c in counts.items():
        grew = {op: (first.operators[op], n) for op, n in c.operators.items() if n != first.operators[op]}
        assert estimator in PER_REPLICATE or c.operators == first.operators, (
            f"{estimator} ({mask or 'bidirectional'}): {sum(c.operators.values())} operator calls at R = {r} against "
            f"{sum(first.operators.values())} at R = {R_VALUES[0]}; (R = {R_VALUES[0]}, R = {r}) per operator: {grew}")
        assert c.uploads == first.uploads, f"{c.uploads} uploads at R = {r}, {first.uploads} at R = {R_VALUES[0]}"
        assert c.draws == first.draws <= 1, f"{c.draws} draw calls at R = {r}, {first.draws} at R = {R_VALUES[0]}"
        assert c.qr == first.qr, f"{c.qr} QRs at R = {r}, {first.qr} at R = {R_VALUES[0]}"
    if estimator == "rfa:coupling=orthogonal":
        # S = 5 rows in D = 4: one full D x D block and one block of S mod D rows, each one QR over the stack
        assert first.qr == 2, f"orthogonal features: {first.qr} QRs per unit, not one per block shape"
