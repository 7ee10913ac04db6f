#!/usr/bin/env bash
# The day a GPU is lent: one command that checks randattn on CUDA and measures W1 there, into one results folder.
#
#   bash benchmarks/gpu.sh [OUT]          (default OUT: gpu-results)
#
# 1. tests/gpu/test_cuda.py (pytest -m gpu): every registered estimator's batched form on cuda against its float64
#    reference (float64 <= 1e-10; float32 within the conformance kit's bound), causal forms too, and a sweep on cuda
#    against the CPU's table in float64;
# 2. W1 (benchmarks/bench_sweep.py --device cuda): wall time, peak RSS and peak GPU memory per process, the per-cell
#    table and W1 against its matrix-product floor (GEMMs timed on the same GPU);
# 3. OUT/results.json: the GPU (nvidia-smi), torch and CUDA versions, the test summary and W1's numbers.
#
# Needs a CUDA build of torch (the CPU wheel of the README's commands has none): install randattn as the README says,
# then e.g. `pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128`.
# Without a CUDA device it says so and exits 0 having run nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-results}
if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "skipped: no CUDA device (torch $(python -c 'import torch; print(torch.__version__)'), torch.cuda.is_available() is False)"
  exit 0
fi
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/nvidia-smi.csv" 2>/dev/null || true
echo "+ pytest -m gpu tests/gpu/test_cuda.py"
status=0
python -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_cuda.py --junitxml "$out/tests.xml" \
  | tee "$out/tests.txt" || status=$?
echo "+ python benchmarks/bench_sweep.py --device cuda --workdir $out/w1"
python benchmarks/bench_sweep.py --device cuda --workdir "$out/w1" | tee "$out/w1.txt"
python - "$out" "$status" <<'EOF'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path

import torch

out, status = Path(sys.argv[1]), int(sys.argv[2])
suite = ET.parse(out / "tests.xml").getroot()
suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
w1 = json.loads((out / "w1" / "bench_sweep.json").read_text())
results = {
    "gpu": torch.cuda.get_device_name(0),
    "gpu_memory_gib": torch.cuda.get_device_properties(0).total_memory / 2**30,
    "torch": torch.__version__,
    "cuda": torch.version.cuda,
    "tests": {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")} | {"exit": status},
    "w1": {key: w1.get(key) for key in ("extrapolated_s", "floor_s", "ratio", "peak_gpu_gib", "wall_s", "layers")},
}
(out / "results.json").write_text(json.dumps(results, indent=1))
print(json.dumps(results, indent=1))
EOF
exit "$status"
