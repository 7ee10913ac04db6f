"""GPU-readiness of the sweep's unit path, without a GPU: what crosses between the host and the device.

The design (ARCHITECTURE §11, issue #26): a unit's inputs go in (q, k, v, the exact attention, the draws) and
only per-replicate sums come out (the metrics' sums, the probability error per (replicate, cell), the IS
diagnostics per query, and once per unit the reference spot check's one (N, Dv) estimate). Nothing of size
N x M or R x N x Dv comes back, and no value is read back to the host inside the computation (``.item()``,
``bool(t)``, ``.tolist()``, ``.numpy()``), which on a GPU would be a synchronisation each.

On this CPU machine there is no second device, so the recorder below marks which tensors *would* live on the
device: those made with an explicit ``device=`` (the engine's uploads ``torch.as_tensor(..., device=)``, the
draws' ``to_torch(device=)``, the estimators' ``torch.empty(..., device=q.device)``), and every result of an op
that takes one (followed through torch's dispatcher, views and in-place ops included). A ``.cpu()`` / ``.to("cpu")``
of a marked tensor is a transfer out; ``.numpy()``, ``.tolist()`` or a scalar read of a marked tensor is a host
read. Each event is attributed to the innermost ``randattn`` function on the stack.

The planted faults at the end show that the recorder can fail: a full (R, N, Dv) difference moved to the host in
the metrics, and an ``.item()`` inside an estimator.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from randattn.activations import make_activations
from randattn.analysis.execute import UnitRunner
from randattn.analysis.sweep import SweepConfig, parse_estimator_list, plan

PACKAGE = str(Path(__import__("randattn").__file__).parent)
#: creation functions whose ``device=`` puts the result on the device
_CREATORS = ("as_tensor", "tensor", "empty", "zeros", "ones", "full", "eye", "arange", "linspace", "rand", "randn",
             "empty_like", "zeros_like", "ones_like", "full_like")


def _site() -> str:
    """``module.function`` of the innermost randattn function on the stack (the test's own frames, comprehensions
    and ``randattn._tensors``, the one conversion of a unit's inputs, whose caller is the site, skipped)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if (path.startswith(PACKAGE) and not frame.f_code.co_name.startswith("<")
                and path != os.path.join(PACKAGE, "_tensors.py")):
            module = Path(path).relative_to(PACKAGE).with_suffix("").as_posix().replace("/", ".")
            return f"{module}.{frame.f_code.co_name}"
        frame = frame.f_back
    return "outside randattn"


class Transfers(TorchDispatchMode):
    """Records ``(kind, site, numel)`` for every transfer in ('in'), transfer out ('out') and host read ('read')
    of device tensors (see the module docstring) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, str, int]] = []
        self._marked: dict[int, weakref.ref] = {}
        self._patches: list[tuple[object, str, object]] = []

    # ---------------------------------------------------------------------------------------------- marks
    def marked(self, t) -> bool:
        ref = self._marked.get(id(t))
        return ref is not None and ref() is t

    def mark(self, t) -> None:
        if isinstance(t, torch.Tensor):
            key = id(t)
            self._marked[key] = weakref.ref(t, lambda _, key=key: self._marked.pop(key, None))

    # ---------------------------------------------------------------------------------------------- dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        on_device = any(self.marked(t) for t in inputs)
        if on_device and func is torch.ops.aten._local_scalar_dense.default:
            self.events.append(("read", _site(), 1))
        out = func(*args, **kwargs)
        if on_device:
            for t in tree_flatten(out)[0]:
                self.mark(t)
        return out

    # ---------------------------------------------------------------------------------------------- patches
    def _patch(self, owner, name, wrapper) -> None:
        self._patches.append((owner, name, getattr(owner, name)))
        setattr(owner, name, wrapper)

    def __enter__(self):
        for name in _CREATORS:
            real = getattr(torch, name)

            @functools.wraps(real)
            def create(*args, _real=real, _name=name, **kwargs):
                result = _real(*args, **kwargs)
                if kwargs.get("device") is not None:
                    if _name in ("as_tensor", "tensor") and args and not (
                            isinstance(args[0], torch.Tensor) and self.marked(args[0])):
                        self.events.append(("in", _site(), result.numel()))
                    self.mark(result)
                return result

            self._patch(torch, name, create)
        recorder = self

        def to_host(real, name):
            @functools.wraps(real)
            def wrapper(t, *args, **kwargs):
                if not recorder.marked(t):
                    return real(t, *args, **kwargs)
                target = kwargs.get("device", args[0] if args else None)
                if name == "to" and not (isinstance(target, (str, torch.device)) and torch.device(target).type
                                         == "cpu"):
                    return real(t, *args, **kwargs)  # a dtype change stays on the device
                recorder.events.append(("out", _site(), t.numel()))
                with _disable_current_modes():
                    return real(t, *args, **kwargs).clone()  # the host copy: unmarked

            return wrapper

        def read(real):
            @functools.wraps(real)
            def wrapper(t, *args, **kwargs):
                if recorder.marked(t):
                    recorder.events.append(("read", _site(), t.numel()))
                return real(t, *args, **kwargs)

            return wrapper

        self._patch(torch.Tensor, "cpu", to_host(torch.Tensor.cpu, "cpu"))
        self._patch(torch.Tensor, "to", to_host(torch.Tensor.to, "to"))
        self._patch(torch.Tensor, "numpy", read(torch.Tensor.numpy))
        self._patch(torch.Tensor, "tolist", read(torch.Tensor.tolist))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for owner, name, real in reversed(self._patches):
                setattr(owner, name, real)
            self._patches.clear()

    def of(self, kind: str) -> dict[str, list[int]]:
        """``site -> [numel, ...]`` of the events of one kind."""
        sites: dict[str, list[int]] = {}
        for k, site, numel in self.events:
            if k == kind:
                sites.setdefault(site, []).append(numel)
        return sites


R, HEADS, N, D, DV, S = 6, 2, 12, 4, 4, 5
#: K: position buckets at most (log2 of N = 12 positions under the causal mask); Q: queries the Pareto k-hat reads
K, Q = 8, 2
#: where a device tensor may be copied to the host, and the most values one copy may hold
ALLOWED_OUT = {
    "analysis.metrics._to_host": R * HEADS * K,  # per-replicate sums (per position bucket under a mask)
    "analysis.estimate_block._dense": R * HEADS,  # the probability error per (replicate, cell)
    "analysis.estimate_block._factored": R * HEADS,
    "analysis.estimate_block._float32_product": R * HEADS,
    # ESS and delta-method spread per (replicate, cell, query); the k-hat's log weights of Q queries (arviz, host)
    "analysis.diagnostics.replicate_snis_diagnostics": max(R * HEADS * N, HEADS * Q * max(S, N)),
    "analysis.execute._reference_deviation": N * DV,  # once per unit: the spot check's one (N, Dv) estimate
    # the relative error of every (replicate, cell, query), for its median, 95th percentile and violation count
    "analysis.relative_error.query_relative_errors": R * HEADS * N,
    # the decode-time estimators' keys used by every (replicate, cell, query), for the budget axis (its mean and
    # position buckets are taken on the host, like the relative errors'), whichever call counted them; and
    # vAttention's log-denominators, for the violation count of its promise
    "analysis.estimate_block._per_query_array": R * HEADS * N,
    # top-k, StreamingLLM, Quest: the budget S lives in the draws, one value per batch element, read back to check it
    "estimators.sparse.selection.budget_of": HEADS,
}
#: where values go to the device: the unit's inputs and exact attention (uploaded once per unit), the draws, the
#: diagnostics' inputs and k-hat query indices; None: any size (inputs), a number: the most values per upload
ALLOWED_IN = {
    "analysis.estimate_block._dense": None, "analysis.estimate_block._factored": None,
    "analysis.estimate_block._float32_product": None, "estimators.base.to_torch": None,
    "analysis.exact_cache.get": None, "analysis.exact_cache.output": None, "analysis.exact_cache.sq_norms": None,
    "analysis.diagnostics.replicate_snis_diagnostics": None,
    # index tables computed from the shapes alone (EVA's chunks and windows, segment counts), never from values
    "estimators.segments.segment_means_torch": N * N, "estimators.eva.batched._t": N * N,
    "estimators.eva.batched._place_rows": N * N,
    # vAttention's per-query sizes (its position-only (N, M) sets are made on the device from them, as
    # sparse.batched.visible_keys and MagicPIG's exact and candidate keys are): N values per upload, never N x M
    "estimators.vattention.batched.select": N, "estimators.vattention.batched._position_sets": N,
    # MagicPIG's binomial tail: its L + 1 exponents and log binomial coefficients (L = S tables), per chunk of queries
    "estimators.magicpig.batched._log_inclusion": S + 1,
    # keys_used takes q and k again where the estimate's form does not count the keys (without probabilities, or a
    # plugin without estimate_with_probabilities_and_keys_used): MagicPIG then computes its selection anew
    "analysis.estimate_block.keys_used": None,
}
#: host reads of device values that the design makes, each with its reason
ALLOWED_READ = {
    # the finiteness check reads on the CPU only; on an accelerator it is skipped (inputs are checked where they
    # enter), which tests/gpu/test_fake_device.py exercises: a read there fails under FakeTensorMode
    "_validation._shape_dtype",
    # LARA asks whether any query's weights underflowed on the CPU only (on an accelerator it redoes every query
    # in log space and keeps what it needs, without a read; test_fake_device runs that path)
    "estimators.lara.batched._rescue_underflowed_queries",
    # a signed estimator's count of non-positive denominators (documented in snis)
    "estimators.snis.__init__.count_non_positive",
    # once per block: whether float32 rounding is negligible decides between the float32 and float64 product
    "analysis.probability_error.probability_rounding_negligible",
    # once per block of LARA's signed weights with diagnostics on: whether any weight is defined
    "estimators.lara.weights.batched_terms",
}
ESTIMATORS = "rfa;rfa:coupling=orthogonal;lara;lara:weighting=balance;ra;eva:window=2;softmax"
#: the decode-time estimators, configured to select among the 12 keys (Quest with pages of one key: S = 5 must be
#: whole pages; MagicPIG's and vAttention's default sinks and local windows would hold every key exact), both budgets
#: of vAttention
DECODE_TIME = ("topk;streaming;quest:page_size=1;magicpig:sinks=1,local=1;vattention:sinks=1,local=1,top_k=1;"
               "vattention:sinks=1,local=1,top_k=1,budget=adaptive")


def _acts(mask: str | None):
    rng = np.random.default_rng(7)
    layer = tuple(rng.normal(size=(1, HEADS, N, d)) for d in (D, D, DV))
    meta = {"scale": 0.5, "model": "synthetic"}
    if mask is not None:
        meta["mask"] = {"0": mask}
    return make_activations({0: layer}, meta)


def _run_units(mask: str | None, estimators: str = ESTIMATORS) -> Transfers:
    acts = _acts(mask)
    config = SweepConfig(estimators=parse_estimator_list(estimators), num_samples=(S,), replicates=R, seed=3,
                         backend="torch", diagnostics=True, khat_queries=Q, check_reference=1.0, mask=mask,
                         dtype="auto")
    runner = UnitRunner(acts, config)
    units = list(plan(acts, config))
    for unit in units:
        runner.blocks(unit)  # the memory calibration runs outside the recorder: it is not the unit path
    with Transfers() as recorder:
        for unit in units:
            runner.run_timed(unit)
    return recorder


def _check(recorder: Transfers) -> None:
    outs, ins, reads = recorder.of("out"), recorder.of("in"), recorder.of("read")
    assert outs, "nothing crossed to the host: the recorder saw no transfer"
    for site, sizes in outs.items():
        assert site in ALLOWED_OUT, f"a transfer to the host from {site} (sizes {sizes}) is not in the design"
        assert max(sizes) <= ALLOWED_OUT[site], f"{site} moved {max(sizes)} values (at most {ALLOWED_OUT[site]})"
    for site, sizes in ins.items():
        assert site in ALLOWED_IN, f"an upload from {site} (sizes {sizes}) is not in the design"
        bound = ALLOWED_IN[site]
        assert bound is None or max(sizes) <= bound, f"{site} uploaded {max(sizes)} values (at most {bound})"
    unexpected = {site: sizes for site, sizes in reads.items() if site not in ALLOWED_READ}
    assert not unexpected, f"host reads of device values: {unexpected}"


@pytest.mark.parametrize("mask", [None, "causal"], ids=["bidirectional", "causal"])
def test_a_unit_moves_inputs_in_and_per_replicate_sums_out(mask):
    estimators = ESTIMATORS if mask is None else "rfa;rfa:coupling=orthogonal;ra;eva;softmax"
    recorder = _run_units(mask, estimators)
    _check(recorder)
    # every unit sends its per-replicate sums back through the metrics' one door, and its inputs in
    assert len(recorder.of("out")["analysis.metrics._to_host"]) >= len(estimators.split(";"))
    assert {"analysis.estimate_block._dense", "estimators.base.to_torch"} <= set(recorder.of("in"))


def test_a_planted_full_transfer_fails(monkeypatch):
    """The metrics copying the whole (R, cells, N, Dv) difference to the host is caught."""
    import randattn.analysis.metrics as metrics

    real = metrics.metrics_of_differences

    def copies_everything(diff, exact, *args, **kwargs):
        diff.cpu()
        return real(diff, exact, *args, **kwargs)

    monkeypatch.setattr(metrics, "metrics_of_differences", copies_everything)
    with pytest.raises(AssertionError, match="is not in the design"):
        _check(_run_units(None, "rfa"))


def test_a_planted_item_call_fails(monkeypatch):
    """An ``.item()`` on a device value inside an estimator is caught as a host read."""
    import randattn

    spec = randattn.get_spec("rfa")

    def syncs(*args, **params):
        out = spec.batched(*args, **params)
        return out / out.abs().max().item()

    planted = dataclasses.replace(spec, forms=spec.forms.replace(estimate=syncs, estimate_with_probabilities=None))
    real_init = UnitRunner.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.specs = {**self.specs, "rfa": planted}

    monkeypatch.setattr(UnitRunner, "__init__", init)
    with pytest.raises(AssertionError, match="host reads of device values"):
        _check(_run_units(None, "rfa"))


@pytest.mark.parametrize("mask", [None, "causal"], ids=["bidirectional", "causal"])
def test_the_decode_time_estimators_move_only_what_the_design_declares(mask):
    """Top-k, StreamingLLM, Quest, MagicPIG and vAttention: their inputs, draws and shape-only sets in; per-replicate
    sums, the keys each query used and (selection) the budget out; no host read of a device value."""
    recorder = _run_units(mask, DECODE_TIME)
    _check(recorder)
    assert len(recorder.of("out")["analysis.metrics._to_host"]) >= len(DECODE_TIME.split(";"))
    assert "analysis.estimate_block._per_query_array" in recorder.of("out")  # the budget axis's counts came back
    # ... from the estimate's own selection: q and k were not uploaded again for a second one, neither for the keys
    # used nor for vAttention's log-denominators (its promise is on the denominator)
    assert "analysis.estimate_block.keys_used" not in recorder.of("in")
    assert "analysis.estimate_block.log_denominator" not in recorder.of("in")
