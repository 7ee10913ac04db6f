"""What a newcomer reads on the terminal: library warnings as a kind and a message (not the source line that
raised them), and counts in the singular where there is one. Real processes: a warning said once per process
must be said in this one."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from randattn.activations import make_activations, save_activations
from _cli_processes import finish


def _run(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", "from randattn.cli import main; main()", *args]
    return finish(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))


@pytest.mark.slow  # over 5 s on the 2-core AVX2 machine: in the slow target
def test_a_library_warning_is_its_kind_and_message_without_a_source_line(tmp_path):
    rng = np.random.default_rng(0)
    layer = tuple(rng.normal(size=(1, 1, 17, 4)) for _ in range(3))  # 17 = 4 x 4 + 1: a ViT's tokens, no grid
    acts = save_activations(make_activations({0: layer}, {"scale": 0.5, "model": "synthetic"}),
                            tmp_path / "acts.safetensors")
    done = _run("mse", str(acts), "-e", "softmax", "--samples", "4", "--replicates", "2", "--out",
                str(tmp_path / "out.csv"))
    assert done.returncode == 0, done.stderr
    said = done.stderr.splitlines()
    assert said[0].startswith(f"warning (NoGridWarning): {acts}: no patch 'grid' in the metadata"), said[:3]
    assert not any(".py:" in line or line.strip().startswith("activations = ") for line in said), said[:3]
    assert said[1].startswith("plan: 1 cell in 1 unit = 1 layer x 1 head x 1 image x 1 (estimator, S) pair"), said[1]
