"""The checks' old home, ``randattn.analysis.theory``, still imports: it warns, naming ``randattn.theory``, and hands
out the new modules themselves (so a monkeypatch through one path is seen through the other)."""

from __future__ import annotations

import importlib
import sys

import pytest

import randattn.analysis
import randattn.theory
import randattn.theory.montecarlo

OLD = "randattn.analysis.theory"


@pytest.fixture
def fresh_old_path(monkeypatch):
    """The alias not imported yet in this process (its warning comes once per import), restored afterwards."""
    for name in [n for n in sys.modules if n == OLD or n.startswith(OLD + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delattr(randattn.analysis, "theory", raising=False)


def test_the_old_path_warns_naming_the_new_one_and_gives_the_same_objects(fresh_old_path):
    with pytest.warns(DeprecationWarning, match=r"randattn\.analysis\.theory moved to randattn\.theory") as caught:
        import randattn.analysis.theory as old
    assert caught[0].filename == __file__  # the warning points at the importing line, not at the import machinery
    assert old is randattn.theory
    assert old.registry is randattn.theory.registry and old._base is randattn.theory._base
    assert randattn.analysis.theory is randattn.theory  # the parent's attribute too


def test_an_old_submodule_path_is_the_new_module(fresh_old_path):
    with pytest.warns(DeprecationWarning, match=r"randattn\.theory"):
        from randattn.analysis.theory import montecarlo
    assert montecarlo is randattn.theory.montecarlo
    assert importlib.import_module(OLD + ".montecarlo") is randattn.theory.montecarlo
    assert importlib.import_module(OLD + "._base") is randattn.theory._base  # private ones too: old tests import them
