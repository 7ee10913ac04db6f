"""Float32 matrix products at full precision while randattn computes (issue #26): TF32 and oneDNN's bfloat16
reductions are off inside ``randattn.estimate`` and every sweep unit, whatever the caller set, and the
caller's settings come back afterwards. A spy estimator reads the settings while it runs; the same spy
called outside randattn sees the caller's values (the negative control: the spy can see a difference).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import torch

import randattn
from randattn._precision import compute_environment, full_precision_matmul
from randattn.activations import make_activations
from randattn.analysis.plan import SweepConfig, parse_estimator_list
from randattn.analysis.sweep import run_sweep
from randattn.estimators.base import BatchedForms
from randattn.estimators.registry import register_estimator, unregister_estimator

SETTINGS = (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul)
pytestmark = pytest.mark.skipif(not all(hasattr(s, "fp32_precision") for s in SETTINGS),
                                reason="this torch has no per-backend fp32_precision settings (the legacy path "
                                       "is tested in a subprocess below)")


def _spy(seen: list):
    softmax = randattn.get_spec("softmax")

    def batched(q, k, v, draws, **kwargs):
        seen.append(tuple(s.fp32_precision for s in SETTINGS))
        return softmax.batched(q, k, v, draws, **kwargs)

    return dataclasses.replace(softmax, name="precision-spy", forms=BatchedForms(estimate=batched))


@pytest.fixture
def user_settings():
    """The caller asked for TF32 on the GPU and bfloat16 on oneDNN; put back whatever was there."""
    before = [s.fp32_precision for s in SETTINGS]
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    yield ("tf32", "bf16")
    for s, value in zip(SETTINGS, before):
        s.fp32_precision = value


def test_estimate_computes_in_ieee_float32_and_restores_the_callers_settings(user_settings):
    seen: list = []
    spy = _spy(seen)
    q = np.random.default_rng(0).standard_normal((2, 5, 4))
    spy.batched(torch.as_tensor(q), torch.as_tensor(q), torch.as_tensor(q), randattn.draw("softmax", q.shape, q.shape))
    assert seen == [user_settings]  # negative control: outside randattn the spy sees the caller's choice
    randattn.estimate(spy, q, q, q, backend="torch")
    assert seen[1] == ("ieee", "ieee")
    assert tuple(s.fp32_precision for s in SETTINGS) == user_settings


def test_every_sweep_unit_computes_in_ieee_float32(user_settings):
    seen: list = []
    register_estimator(_spy(seen))
    try:
        rng = np.random.default_rng(1)
        arrays = {layer: tuple(rng.normal(size=(1, 2, 6, 4)) for _ in range(3)) for layer in (0, 1)}
        acts = make_activations(arrays, {"scale": 0.5, "model": "synthetic"})
        config = SweepConfig(estimators=parse_estimator_list("precision-spy"), num_samples=(1,), replicates=1,
                             seed=0, diagnostics=False, probabilities=False)
        run_sweep(acts, config)
    finally:
        unregister_estimator("precision-spy")
    assert len(seen) >= 2 and set(seen) == {("ieee", "ieee")}
    assert tuple(s.fp32_precision for s in SETTINGS) == user_settings


def test_nesting_restores_each_level():
    before = tuple(s.fp32_precision for s in SETTINGS)
    with full_precision_matmul():
        with full_precision_matmul():
            assert tuple(s.fp32_precision for s in SETTINGS) == ("ieee", "ieee")
        assert tuple(s.fp32_precision for s in SETTINGS) == ("ieee", "ieee")
    assert tuple(s.fp32_precision for s in SETTINGS) == before


@pytest.mark.slow  # 3-5 s on the 2-core AVX2 machine: in the slow target
def test_the_legacy_settings_are_used_where_the_per_backend_ones_are_absent():
    """A torch without per-backend settings: the legacy global precision is 'highest' inside, restored after.
    In a subprocess: torch refuses to read the legacy setting once the per-backend ones have been touched."""
    code = (
        "import torch, randattn._precision as p\n"
        "p._BACKENDS = ('no.such',)\n"
        "torch.set_float32_matmul_precision('medium')\n"
        "with p.full_precision_matmul():\n"
        "    inside = torch.get_float32_matmul_precision()\n"
        "print(inside, torch.get_float32_matmul_precision())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "highest medium"


def test_compute_environment_names_device_and_precision():
    env = compute_environment()
    assert env == {"torch": torch.__version__, "device": "cpu", "device_name": None,
                   "float32_matmul": "ieee (TF32 and bfloat16 reductions off while randattn computes)"}
    assert compute_environment("cpu")["device"] == "cpu"


@pytest.mark.parametrize("backend, dtype", [("torch", "auto"), ("torch", "float64"), ("reference", "auto")])
def test_the_table_metadata_records_device_dtype_and_precision(backend, dtype):
    from randattn.analysis.records import table_metadata

    rng = np.random.default_rng(4)
    acts = make_activations({0: tuple(rng.normal(size=(1, 2, 6, 4)) for _ in range(3))},
                            {"scale": 0.5, "model": "synthetic"})
    config = SweepConfig(estimators=parse_estimator_list("rfa;lara:proposal=eq32,weighting=coupled"),
                         num_samples=(2,), replicates=2, seed=0, backend=backend, dtype=dtype, diagnostics=False)
    table = run_sweep(acts, config)
    compute = table_metadata(config, acts, "t.parquet", table, argv=["randattn"])["compute"]
    assert compute["backend"] == backend and compute["device"] == "cpu"
    if backend == "reference":
        assert compute["dtypes"] == ["float64"] and compute["float32_matmul"] is None
    else:
        # auto: float32 for RFA, float64 for signed LARA; float64 for both when asked
        assert compute["dtype"] == dtype and compute["torch"] == torch.__version__
        assert compute["dtypes"] == (["float32", "float64"] if dtype == "auto" else ["float64"])
        assert compute["float32_matmul"].startswith("ieee")
