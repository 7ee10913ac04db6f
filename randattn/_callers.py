"""Where a warning points: at the first caller outside the randattn package, however deep inside it it was raised.

A fixed ``stacklevel`` counts frames, and is right from one call path only (an estimator's warning raised three
calls deep from one entry point and five from another). :func:`outside_stacklevel` counts them at the moment of
warning, so that ``warnings.warn(..., stacklevel=outside_stacklevel())`` names the user's line whichever entry
point they called. (Python 3.12's ``skip_file_prefixes`` does the same for ``warnings.warn``; the project runs on
3.10 too.)
"""

from __future__ import annotations

import os
import sys

__all__ = ["outside_stacklevel"]

#: the package's folder, with a trailing separator: a frame whose file is below it is randattn's own
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def outside_stacklevel() -> int:
    """The ``stacklevel`` that makes a ``warnings.warn`` in the calling function point at the first frame, going
    outwards, whose file is not in the randattn package.

    1 is the function that calls this one (as ``warnings.warn``'s stacklevel 1 is the function that warns). Where
    every frame is randattn's (the command line, its own entry point), the outermost frame is named.

    Returns
    -------
    int
        The level, >= 1.
    """
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(PACKAGE_DIR):
        frame = frame.f_back
        level += 1
    return level
