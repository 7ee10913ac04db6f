#!/usr/bin/env bash
# The plugin end to end, as a user runs it: install it beside randattn, then every randattn command that takes an
# estimator uses it (estimators, check, mse in-process and on two Dask worker processes, plot, report), on a
# synthetic activation file (2 layers x 2 heads x 64 tokens, key norms ~ 8). CI runs this after the test suite.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

python -m pip install -q --no-deps --no-build-isolation -e "$here"
python - "$work/acts.safetensors" <<'PY'
import sys
import numpy as np
from randattn.activations import make_activations, save_activations
from randattn.activations.synthetic import gaussian_qkv

rng = np.random.default_rng(0)
layers = {}
for layer in (0, 1):
    s = gaussian_qkv(64, 16, batch=(1, 2), q_norm=8.0, k_norm=8.0, rng=rng)
    layers[layer] = (s.q, s.k, s.v)
save_activations(make_activations(layers, {"scale": 0.25, "model": "synthetic"}), sys.argv[1])
PY

randattn estimators --json | python -c "import json, sys; assert 'nystrom' in [r['name'] for r in json.load(sys.stdin)]"
randattn check nystrom
common=(-e nystrom -e "nystrom:pinv=exact" -e rfa --samples 8,16 --replicates 4 --seed 3 --threads 1)
randattn mse "$work/acts.safetensors" "${common[@]}" --out "$work/local.parquet"
randattn mse "$work/acts.safetensors" "${common[@]}" --scheduler processes:2 --out "$work/dask.parquet"
python - "$work/local.parquet" "$work/dask.parquet" <<'PY'
import sys
import pandas as pd
local, dask = (pd.read_parquet(p).drop(columns="seconds") for p in sys.argv[1:])
pd.testing.assert_frame_equal(local, dask, check_exact=True)
assert {"nystrom", "nystrom:pinv=exact"} <= set(local.label)
print(f"nystrom: the same {len(local)}-row table in-process and on 2 Dask workers")
PY
randattn plot "$work/local.parquet" --kind all --out "$work/figures"
randattn report "$work/local.parquet" --out "$work/report"
grep -q "Nyströmformer" "$work/report/report.html"
python -m pytest -q -p no:cacheprovider "$here/tests"
