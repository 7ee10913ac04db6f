"""Start-up (issue 9, target 2): heavy modules load only in the commands and code paths that need them.

Checked in a fresh interpreter each, since this test process has imported everything already.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "arviz", "matplotlib", "onnxruntime")

_PROBE = """
import sys
sys.argv = ["randattn", *{args!r}]
{setup}
from randattn.cli import main
try:
    main()
except SystemExit:
    pass
print("HEAVY:" + ",".join(m for m in {heavy!r} if m in sys.modules))
"""


def _heavy_after(args: tuple[str, ...], setup: str = "") -> list[str]:
    code = _PROBE.format(args=list(args), heavy=HEAVY, setup=setup)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    marker = [line for line in proc.stdout.splitlines() if line.startswith("HEAVY:")][-1]
    return [m for m in marker[len("HEAVY:"):].split(",") if m]


@pytest.mark.parametrize("args", [("--help",), ("mse", "--help"), ("plot", "--help"), ("report", "--help")],
                         ids=lambda a: " ".join(a))
def test_help_loads_no_heavy_module(args):
    assert _heavy_after(args) == []


def test_the_sweep_modules_load_no_heavy_module():
    """Plotting and reporting import the sweep's table helpers; torch comes only with a torch-backend run."""
    assert _heavy_after(("--help",), setup="import randattn.analysis.sweep, randattn.analysis.execute") == []
