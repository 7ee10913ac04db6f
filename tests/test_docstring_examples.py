"""Every example in the package's docstrings runs and shows what it says (``doctest``), so that an example a
reader copies cannot drift from the code. The modules are found by their text (a line starting ``>>>``), not
listed by hand, so a new module's examples are checked without a change here."""

from __future__ import annotations

import doctest
import importlib
import pathlib

import pytest

import randattn

PACKAGE = pathlib.Path(randattn.__file__).parent
#: every module whose source holds an example, as a dotted name
MODULES_WITH_EXAMPLES = sorted(
    ".".join(("randattn", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")
    for path in PACKAGE.rglob("*.py")
    if any(line.lstrip().startswith(">>> ") for line in path.read_text(encoding="utf-8").splitlines())
)


def test_the_examples_are_found():
    """A negative control for the search: modules known to hold examples are among those found."""
    assert {"randattn.api", "randattn.estimators.vattention.reference",
            "randattn.estimators.magicpig.reference"} <= set(MODULES_WITH_EXAMPLES)


@pytest.mark.parametrize("name", MODULES_WITH_EXAMPLES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner()
    tests = finder.find(module, name)
    assert sum(len(test.examples) for test in tests) > 0, f"{name} holds '>>>' lines but doctest finds no example"
    for test in tests:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed (output above)"
