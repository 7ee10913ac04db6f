"""On a real GPU (``pytest -m gpu``, or ``bash benchmarks/gpu.sh``): every registered estimator's batched form on
``cuda`` against its float64 reference, and the sweep's unit path on ``cuda`` against the CPU.

Tolerances: float64 on the GPU == reference to 1e-10 (summation order alone gives ~1e-15; ARCHITECTURE sec. 3,
the same bound as on the CPU). float32 within ``8 L eps32 max|v|`` plus the reference's own scale times
``64 eps32``, L the largest |logit|: the rounding of a logit of size L carried through a softmax, the conformance
kit's float32 bound (``randattn.testing.checks``); estimators with signed weights cancel in float32 and are held
to the float64 check only, as on the CPU. The sweep on ``cuda`` in float64 equals the CPU's table to 1e-9
relative (the float64 metrics of the same estimates) plus a floor of 1e-14 of each column's largest value, the
golden-table test's rule (``randattn.testing.assert_close_to_rounding``): softmax's rows hold its float64 rounding
(~1e-33), which the GPU's summation order moves by tens of percent.

Without a CUDA device every test here is skipped, saying so: the CPU-only CI proves GPU-readiness with the
fake-device tests beside this file.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch

import randattn
from randattn.testing import all_variants, assert_close_to_rounding, variant_id

#: the device under test; RANDATTN_TEST_DEVICE=cpu runs the same checks on the CPU (how they were validated
#: on a machine with no GPU)
DEVICE = os.environ.get("RANDATTN_TEST_DEVICE", "cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE.startswith("cuda") and not torch.cuda.is_available(),
                       reason="no CUDA device (torch.cuda.is_available() is False); run on a GPU machine with "
                              "`bash benchmarks/gpu.sh`"),
]
EPS32 = float(np.finfo(np.float32).eps)


def _inputs(params, seed=0, n=13, m=13, d=8, dv=5):
    from randattn.estimators.grid import parse_grid

    grid = parse_grid(params.get("grid"))
    if grid is not None and params.get("layout", "grid") == "grid":
        n = m = params.get("prefix_tokens", 0) + grid[0] * grid[1]
    rng = np.random.default_rng(seed)
    return rng.standard_normal((2, 3, n, d)), rng.standard_normal((2, 3, m, d)), rng.standard_normal((2, 3, m, dv))


def _compare(name, params, mask=None):
    from randattn.estimators.snis import NonPositiveDenominatorWarning

    with warnings.catch_warnings():  # a signed estimator's report; the comparison covers those queries too
        warnings.simplefilter("ignore", NonPositiveDenominatorWarning)
        _compare_quietly(name, params, mask)


def _compare_quietly(name, params, mask):
    spec = randattn.get_spec(name)
    q, k, v = _inputs(params)
    resolved = spec.resolve_params(params)
    masked = {} if mask is None else {"mask": mask}
    draws = spec.draw(q.shape, k.shape, num_samples=6 if spec.needs_samples else None, replicates=2,
                      rng=np.random.default_rng(1), **resolved, **masked)
    ref = np.asarray(spec.reference(q, k, v, draws, scale=None, **resolved, **masked), dtype=np.float64)
    for dtype in (torch.float64, torch.float32):
        if dtype == torch.float32 and spec.has_signed_weights(resolved):
            continue
        on_device = [torch.as_tensor(a, dtype=dtype, device=DEVICE) for a in (q, k, v)]
        out = spec.batched(*on_device, draws.to_torch(device=DEVICE, dtype=dtype), scale=None, **resolved, **masked)
        assert out.device == torch.device(DEVICE) or out.device.type == torch.device(DEVICE).type
        got = out.double().cpu().numpy()
        if dtype == torch.float64:
            np.testing.assert_allclose(got, ref, atol=1e-10, rtol=1e-10, err_msg=f"{name} {params} float64 on {DEVICE}")
        else:
            logit = float(np.abs(q @ np.swapaxes(k, -1, -2)).max()) * q.shape[-1] ** -0.5
            atol = 8 * logit * EPS32 * float(np.abs(v).max()) + 64 * EPS32 * float(np.abs(ref).max())
            np.testing.assert_allclose(got, ref, atol=atol, rtol=0, err_msg=f"{name} {params} float32 on {DEVICE}")


@pytest.mark.parametrize("case", all_variants(), ids=variant_id)
def test_batched_on_cuda_equals_the_reference(case):
    name, _, params = case
    _compare(name, params)


#: every configuration of the catalogue that has a causal form (each variant's own parameters: Quest's default page
#: of 16 keys would not divide the test's S = 6)
CAUSAL_VARIANTS = [case for case in all_variants()
                   if randattn.get_spec(case[0]).supports_mask("causal", randattn.get_spec(case[0]).resolve_params(case[2]))]


@pytest.mark.parametrize("case", CAUSAL_VARIANTS, ids=variant_id)
def test_causal_batched_on_cuda_equals_the_reference(case):
    name, _, params = case
    _compare(name, params, mask="causal")


def test_the_sweep_on_cuda_equals_the_cpu_in_float64():
    from randattn.activations import make_activations
    from randattn.analysis.plan import SweepConfig, parse_estimator_list
    from randattn.analysis.sweep import run_sweep

    rng = np.random.default_rng(2)
    arrays = {layer: tuple(rng.normal(size=(2, 3, 17, 8)) for _ in range(3)) for layer in (0, 1)}
    acts = make_activations(arrays, {"scale": 0.35, "model": "synthetic"})
    tables = {}
    for device in ("cpu", DEVICE):
        config = SweepConfig(estimators=parse_estimator_list("rfa;ra;eva;lara"), num_samples=(4, 8), replicates=4,
                             seed=3, dtype="float64", device=device)
        tables[device] = run_sweep(acts, config)
    cpu, gpu = tables["cpu"], tables[DEVICE]
    for column in ("mse", "bias_sq", "variance", "prob_mse"):
        assert_close_to_rounding(gpu[column].to_numpy(float), cpu[column].to_numpy(float), rtol=1e-9,
                                 what=f"{column} on {DEVICE}")
