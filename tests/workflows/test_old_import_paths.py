"""The demos' old homes, ``randattn.reports.demo`` and ``randattn.reports.demo_lm``, still import: each warns, naming
its new home in ``randattn.workflows``, and gives the new module itself (so a monkeypatch through one path is seen
through the other)."""

from __future__ import annotations

import importlib
import sys

import pytest

import randattn.reports
import randattn.workflows.demo
import randattn.workflows.demo_lm


@pytest.fixture
def fresh_old_paths(monkeypatch):
    """The aliases not imported yet in this process (each warns once per import), restored afterwards."""
    for name in ("demo", "demo_lm"):
        monkeypatch.delitem(sys.modules, f"randattn.reports.{name}", raising=False)
        monkeypatch.delattr(randattn.reports, name, raising=False)


def test_the_old_demo_path_warns_naming_the_new_one_and_is_the_new_module(fresh_old_paths):
    moved = r"randattn\.reports\.demo moved to randattn\.workflows\.demo;"
    with pytest.warns(DeprecationWarning, match=moved) as caught:
        from randattn.reports.demo import DemoConfig, run_demo
    assert caught[0].filename == __file__  # the warning points at the importing line, not at the import machinery
    assert run_demo is randattn.workflows.demo.run_demo and DemoConfig is randattn.workflows.demo.DemoConfig
    assert importlib.import_module("randattn.reports.demo") is randattn.workflows.demo


def test_the_old_demo_lm_path_warns_naming_the_new_one_and_is_the_new_module(fresh_old_paths):
    with pytest.warns(DeprecationWarning, match=r"randattn\.reports\.demo_lm moved to randattn\.workflows\.demo_lm"):
        import randattn.reports.demo_lm as old
    assert old is randattn.workflows.demo_lm and old.run_demo_lm is randattn.workflows.demo_lm.run_demo_lm
    assert randattn.reports.demo_lm is randattn.workflows.demo_lm  # the parent's attribute too
