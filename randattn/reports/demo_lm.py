"""Deprecated alias of :mod:`randattn.workflows.demo_lm`, where the language-model demo now lives.

A demo chains capture, sweep and report: a workflow above ``randattn.reports``, not a report.
``import randattn.reports.demo_lm`` warns with a :class:`DeprecationWarning` naming the new home and gives the new
module itself (``randattn.reports.demo_lm is randattn.workflows.demo_lm``), so every name of it, and a monkeypatch
through either path, is the same.

The new home is loaded by name (``importlib``) rather than by an ``import`` statement: this alias is the only path
from ``randattn.reports`` up to ``randattn.workflows``, and it is there for old callers alone.
"""

from __future__ import annotations

import importlib
import sys
import warnings

#: where this module now lives
NEW_HOME = "randattn.workflows.demo_lm"

warnings.warn(f"{__name__} moved to {NEW_HOME}; import it from there (this alias will be removed)",
              DeprecationWarning, stacklevel=2)

# the import system hands out what stands in sys.modules under this name once this file has run: the new module
sys.modules[__name__] = importlib.import_module(NEW_HOME)
