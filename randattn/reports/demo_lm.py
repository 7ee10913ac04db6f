"""Deprecated alias of :mod:`randattn.workflows.demo_lm`, where the language-model demo now lives.

``randattn.reports.demo_lm is randattn.workflows.demo_lm`` after a :class:`DeprecationWarning` naming the new home;
why, and why by name: :mod:`randattn.reports.demo`."""

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
