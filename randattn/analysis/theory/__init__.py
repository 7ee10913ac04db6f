"""Deprecated alias of :mod:`randattn.theory`, where the papers' propositions and their checks now live.

The checks verify the estimators (and the sweep's ground truth); they measure nothing, so they stand beside
``randattn.analysis`` rather than inside it. ``import randattn.analysis.theory``, or one of its submodules
(``randattn.analysis.theory.montecarlo``), warns with a :class:`DeprecationWarning` naming the new home and gives
the new modules themselves: ``randattn.analysis.theory is randattn.theory``.

The new home is loaded by name (``importlib``) rather than by an ``import`` statement: this alias is the only path
from ``randattn.analysis`` up to ``randattn.theory``, and it is there for old callers alone.
"""

from __future__ import annotations

import importlib
import sys
import warnings

#: where everything of this package now lives
NEW_HOME = "randattn.theory"
#: the submodules of the new home, each importable under this package's name too
SUBMODULES = ("montecarlo", "_base", "_causal", "_decode", "_eva", "_lara", "_performer", "_sderf", "_stability")

warnings.warn(f"{__name__} moved to {NEW_HOME}; import it from there (this alias will be removed)",
              DeprecationWarning, stacklevel=2)

for _name in SUBMODULES:
    # an entry under the old dotted name makes ``import randattn.analysis.theory.montecarlo`` find the new module
    # (not load its file a second time as another module)
    sys.modules[f"{__name__}.{_name}"] = importlib.import_module(f"{NEW_HOME}.{_name}")
# the import system hands out what stands in sys.modules under this name once this file has run: the new package
sys.modules[__name__] = importlib.import_module(NEW_HOME)
