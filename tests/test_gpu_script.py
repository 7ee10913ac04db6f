"""``benchmarks/gpu.sh --activations DIR``: W1 from activations captured elsewhere, with the CPU baseline of the same
machine beside it. Its CPU path (``--device cpu``) is run here, so the script is known to run before a GPU is lent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from randattn.activations import make_activations, save_activations

REPO = Path(__file__).resolve().parents[1]
CAPTURE = "randattn capture --model dinov2-s14 --images skimage:astronaut,coffee,chelsea,rocket --size {size} " \
          "--out acts{size}.safetensors"


def _gpu_sh(*args, timeout: float = 900, **env_vars: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", "1")  # small machines run tests side by side
    env.update(env_vars)
    return subprocess.run(["bash", str(REPO / "benchmarks" / "gpu.sh"), *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=timeout)


def test_missing_captures_are_named_with_their_capture_commands_before_any_work(tmp_path):
    folder, out = tmp_path / "acts", tmp_path / "results"
    folder.mkdir()
    (folder / "acts336.safetensors").write_bytes(b"")  # present (read later); the other two are missing
    result = _gpu_sh("--activations", folder, "--device", "cpu", out)
    assert result.returncode != 0, result.stdout
    said = result.stderr
    assert f"missing {folder}/acts196.safetensors, {folder}/acts392.safetensors;" in said
    for size in (196, 392):
        assert CAPTURE.format(size=size) in said
    assert CAPTURE.format(size=336) not in said
    assert not out.exists()  # nothing ran


def _program(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return path


def test_an_image_without_a_plain_python_uses_python3(tmp_path):
    """GPU images often have python3 alone (or a `python` without torch): the script finds the one that works."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    _program(stubs / "python", "echo 'python: not this one' >&2; exit 127")
    # a wrapper, not a link: a link to a virtual environment's interpreter loses the environment
    _program(stubs / "python3", f'exec "{sys.executable}" "$@"')
    folder = tmp_path / "acts"
    folder.mkdir()
    result = _gpu_sh("--activations", folder, "--device", "cpu", "--sizes", "196", tmp_path / "results",
                     PATH=f"{stubs}{os.pathsep}{os.environ['PATH']}")
    assert f"missing {folder}/acts196.safetensors;" in result.stderr, result.stderr  # got as far as the file check
    assert "not this one" not in result.stderr


def test_no_interpreter_with_torch_and_randattn_is_refused_by_name(tmp_path):
    broken = _program(tmp_path / "python-without-torch", "exit 1")
    result = _gpu_sh("--device", "cpu", tmp_path / "results", PYTHON=str(broken))
    assert result.returncode == 2
    assert f"no interpreter that imports torch and randattn (tried: {broken})" in result.stderr
    assert not (tmp_path / "results").exists()


def test_a_missing_folder_is_refused(tmp_path):
    result = _gpu_sh("--activations", tmp_path / "nowhere", "--device", "cpu", tmp_path / "results")
    assert result.returncode == 2 and f"--activations {tmp_path}/nowhere is not a folder" in result.stderr


@pytest.mark.slow  # two W1 runs (each two sweep processes) on a one-head, one-layer file: minutes on 2 cores
def test_the_cpu_path_runs_w1_and_its_baseline_from_captured_files(tmp_path):
    """A stand-in for acts196 (1 image, 1 head, 7 x 7 patches and a CLS token): the script's whole path on the CPU."""
    rng = np.random.default_rng(0)
    folder, out = tmp_path / "acts", tmp_path / "results"
    arrays = {0: tuple(0.3 * rng.normal(size=(1, 1, 50, 8)) for _ in range(3))}
    save_activations(make_activations(arrays, {"scale": 8**-0.5, "model": "synthetic", "grid": [7, 7],
                                               "prefix_tokens": 1}), folder / "acts196.safetensors")
    result = _gpu_sh("--activations", folder, "--device", "cpu", "--sizes", "196", "--layers", "0",
                     "--long-tokens", "256", "--causal-sizes", "256", out)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    w1, cpu = results["w1"], results["w1_cpu"]
    assert w1["device"] == cpu["device"] == "cpu" and w1["layers"] == cpu["layers"] == [0]
    assert results["cpu_over_device"] == pytest.approx(cpu["extrapolated_s"] / w1["extrapolated_s"], rel=1e-12)
    assert f"cpu / cpu = {results['cpu_over_device']:.2f}x" in result.stdout
    (long,) = results["long_context"]  # the long-context step, at 256 tokens here
    assert (long["N"], long["heads"], long["device"], long["exit"]) == (256, 9, "cpu", 0)
    causal = results["causal_performer"]  # the causal Performer step; its accuracy on the stand-in's head
    assert causal["device"] == "cpu" and [row["n"] for row in causal["rows"]] == [256]
    assert causal["rows"][0]["ours_invariant"] is True
    assert "ours (float32)" in causal["accuracy"][1] and "all finite: True" in causal["accuracy"][1]
    for work in ("w1", "w1-cpu"):  # one table per file and group, named after the file
        assert sorted(p.name for p in (out / work).glob("*.parquet")) == ["w1-acts196-main.parquet",
                                                                           "w1-acts196-ra.parquet"]
