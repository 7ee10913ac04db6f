"""GPU-readiness without a GPU: every registered estimator's batched form runs on an accelerator device under
torch's ``FakeTensorMode``, which builds tensors on a device without allocating them and raises on exactly the
faults that break a GPU run: an operand left on the CPU (device mismatch) and a read of a value back to the host
(``.item()``, ``bool(tensor)``, ``.tolist()``, data-dependent shapes) inside the estimator.

The device is ``meta``, not ``cuda``: in this CPU build of torch, a fake ``cuda`` tensor's ``contiguous()`` and
advanced indexing reach CUDA's device guard, which the build lacks ("PyTorch is not linked with support for cuda
devices"), so fake ``cuda`` cannot run code that is correct on a GPU. A fake ``meta`` tensor raises the same
device-mismatch and data-dependent errors (shown by the planted faults below).

Two planted faults show that the harness can fail: an ``.item()`` and a CPU tensor added to the output.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import randattn
from randattn.estimators.base import Draws
from randattn.testing import all_variants, variant_id

DEVICE = "meta"
#: (q, k, v) shapes: batch dims, N != M, Dv != D
SHAPES = ((2, 3, 13, 8), (2, 3, 13, 8), (2, 3, 13, 5))


def _fit(params, shapes):
    """Grid variants need N = M = prefix + h * w tokens."""
    from randattn.estimators.grid import parse_grid

    grid = parse_grid(params.get("grid"))
    if grid is None or params.get("layout", "grid") != "grid":
        return shapes
    tokens = params.get("prefix_tokens", 0) + grid[0] * grid[1]
    return tuple((*s[:-2], tokens, s[-1]) for s in shapes)


@pytest.fixture(autouse=True)
def signed_reports_read_nothing(monkeypatch):
    """A signed estimator's non-positive-denominator report is the one host read it makes by design
    (``snis.count_non_positive``, documented there); here it reads nothing, so any other sync still fails."""
    import randattn.estimators.snis as snis

    monkeypatch.setattr(snis, "count_non_positive", lambda sign: 0)


def run_on_fake_device(spec, params, shapes=SHAPES, dtype=torch.float32, mask=None):
    """The batched form on fake CUDA tensors; draws made on the host (as the engine does) and moved once."""
    q_shape, k_shape, v_shape = _fit(params, shapes)
    resolved = spec.resolve_params(params)
    kwargs = {"mask": mask} if mask is not None else {}
    draws = spec.draw(q_shape, k_shape, num_samples=16 if spec.needs_samples else None, replicates=2,
                      rng=np.random.default_rng(0), **resolved, **kwargs)
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v = (torch.empty(s, dtype=dtype, device=DEVICE) for s in (q_shape, k_shape, v_shape))
        fake = Draws({key: torch.empty(np.shape(a), dtype=dtype, device=DEVICE) for key, a in draws.arrays.items()},
                     draws.replicates)
        out = spec.batched(q, k, v, fake, scale=None, **resolved, **kwargs)
        assert out.device.type == DEVICE and tuple(out.shape) == (2, *q_shape[:-1], v_shape[-1])
        return out


def _first_variant_by_default() -> list:
    """Every registered variant; beyond each estimator's first one only with -m slow (18 s in all on the 2-core
    machine, where the others share the first one's code paths but for a parameter)."""
    seen: set[str] = set()
    cases = []
    for case in all_variants():
        marks = () if case[0] not in seen else (pytest.mark.slow,)
        seen.add(case[0])
        cases.append(pytest.param(case, marks=marks, id=variant_id(case)))
    return cases


@pytest.mark.parametrize("case", _first_variant_by_default())
def test_batched_runs_on_an_accelerator_without_host_syncs(case):
    name, _, params = case
    run_on_fake_device(randattn.get_spec(name), params)


@pytest.mark.parametrize("name", [n for n in randattn.list_estimators() if randattn.get_spec(n).supports_mask("causal")])
def test_causal_batched_runs_on_an_accelerator_without_host_syncs(name):
    run_on_fake_device(randattn.get_spec(name), {}, mask="causal")


@pytest.mark.parametrize("mask", [None, "causal"], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("name", randattn.list_estimators())
def test_probability_forms_run_on_an_accelerator_without_host_syncs(name, mask):
    """The forms the engine calls with probabilities on (``forms.estimate_with_probabilities``,
    ``forms.probabilities``) under both masks an estimator supports."""
    spec = randattn.get_spec(name)
    if mask is not None and not spec.supports_mask(mask):
        pytest.skip(f"{name} does not support mask={mask}")
    kwargs = {"mask": mask} if mask is not None else {}
    q_shape, k_shape, _ = SHAPES
    draws = spec.draw(q_shape, k_shape, num_samples=16 if spec.needs_samples else None, replicates=2,
                      rng=np.random.default_rng(0), **spec.resolve_params({}), **kwargs)
    forms = [form for form in ("estimate_with_probabilities", "probabilities") if spec.forms.has(form)]
    if not forms:
        pytest.skip(f"{name} has no probability form (the engine uses batched with identity values)")
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v = (torch.empty(s, dtype=torch.float32, device=DEVICE) for s in SHAPES)
        fake = Draws({key: torch.empty(np.shape(a), dtype=torch.float32, device=DEVICE)
                      for key, a in draws.arrays.items()}, draws.replicates)
        for form in forms:
            args = (q, k, v, fake) if form == "estimate_with_probabilities" else (q, k, fake)
            result = spec.forms.get(form)(*args, scale=None, **spec.resolve_params({}), **kwargs)
            for t in result if isinstance(result, tuple) else (result,):
                assert t.device.type == DEVICE


def test_a_planted_item_call_fails():
    rfa = randattn.get_spec("rfa")

    def syncs(*args, **params):
        out = rfa.batched(*args, **params)
        return out / out.abs().max().item()  # reads a value back to the host

    with pytest.raises(Exception, match="local_scalar_dense|data-dependent|DataDependent"):
        run_on_fake_device(dataclasses.replace(rfa, forms=rfa.forms.replace(estimate=syncs)), {})


def test_a_planted_cpu_tensor_fails():
    rfa = randattn.get_spec("rfa")

    def left_on_cpu(q, k, v, draws, **params):
        out = rfa.batched(q, k, v, draws, **params)
        return out + torch.ones(out.shape[-1])  # created on the CPU

    with pytest.raises(Exception, match="found at least two devices, meta and cpu"):
        run_on_fake_device(dataclasses.replace(rfa, forms=rfa.forms.replace(estimate=left_on_cpu)), {})
