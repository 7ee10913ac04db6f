"""The measurement, plotting and report code ask an estimator's spec and never test its name.

The rule (estimator protocol issue): "The measurement, plotting and report code ask the spec and never test
an estimator's name." Built-ins and plugins are treated alike, so a plugin named ``nystrom`` works in the plan,
tables, figures and the HTML report without a line of randattn changed. A test such as ``name == "rfa"`` or
``name not in ("rfa", "lara")`` breaks that silently: the plugin gets the fall-through branch.

This walks the AST of every module under ``randattn/analysis``, ``randattn/theory``, ``randattn/reports``,
``randattn/workflows``, ``randattn/cli`` and ``randattn/results`` (the table that the measurement writes and the
reports read) and fails on a comparison (``==``, ``!=``, ``in``, ``not in``) or a ``match`` case one of whose sides is a built-in
estimator's name: a string constant, or a tuple, list, set or dict literal holding one (as an element or a
key). Lists of *which* estimators to run (``DEFAULT_ESTIMATORS``) are configuration, not comparisons, and pass.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from randattn.estimators.registry import BUILTIN_ENTRY_POINTS

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("randattn/analysis", "randattn/theory", "randattn/reports", "randattn/workflows", "randattn/cli",
           "randattn/results")
#: the built-in estimators' registry names: a comparison with one of them is a name test
BUILTIN_NAMES = frozenset(name for name, _ in BUILTIN_ENTRY_POINTS)
_OPS = (ast.Eq, ast.NotEq, ast.In, ast.NotIn)

#: (file, the comparison as ``ast.unparse`` writes it) -> why it is not a name test. Only genuine
#: configuration belongs here; every entry must still match something (a stale entry fails).
ALLOWED: dict[tuple[str, str], str] = {
    # the Dask scheduler called "local" (run in this process), not the local-attention estimator
    ("randattn/analysis/executors.py", "text == 'local'"): "the --scheduler value 'local'",
    ("randattn/analysis/sweep_run.py", "spec.kind == 'local'"): "Scheduler.kind 'local' (this process)",
    ("randattn/cli/_mse_session.py", "where.kind == 'local'"): "Scheduler.kind 'local' (no Dask client)",
}


def _names_in(node: ast.AST) -> list[str]:
    """The built-in estimator names ``node`` holds as a literal: a string, or a container literal's elements or keys."""
    if isinstance(node, ast.Constant):
        return [node.value] if isinstance(node.value, str) and node.value in BUILTIN_NAMES else []
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [name for element in node.elts for name in _names_in(element)]
    if isinstance(node, ast.Dict):
        return [name for key in node.keys if key is not None for name in _names_in(key)]
    return []


def name_tests(source: str) -> list[tuple[int, str, list[str]]]:
    """Every name test in ``source``: (line, the comparison's text, the names it tests)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            names = [name for i, op in enumerate(node.ops) if isinstance(op, _OPS)
                     for side in (sides[i], sides[i + 1]) for name in _names_in(side)]
            if names:
                found.append((node.lineno, ast.unparse(node), names))
        elif isinstance(node, ast.match_case):
            patterns = [p.value for p in ast.walk(node.pattern) if isinstance(p, ast.MatchValue)]
            names = [name for value in patterns for name in _names_in(value)]
            if names:
                found.append((node.pattern.lineno, f"case {ast.unparse(node.pattern)}", names))
    return sorted(found)


def _modules() -> list[Path]:
    return sorted(path for folder in SCANNED for path in (ROOT / folder).rglob("*.py"))


def test_the_scan_covers_the_modules_and_knows_the_builtin_names():
    assert {"softmax", "rfa", "ra", "lara", "eva", "scatterbrain", "local"} <= BUILTIN_NAMES
    scanned = {path.relative_to(ROOT).as_posix() for path in _modules()}
    for module in ("randattn/analysis/plan.py", "randattn/reports/html.py", "randattn/reports/figures.py",
                   "randattn/reports/tables.py", "randattn/cli/demo.py", "randattn/theory/_stability.py",
                   "randattn/workflows/demo.py"):
        assert module in scanned


@pytest.mark.parametrize(
    ("source", "names"),
    [
        ('if self.name == "lara":\n    pass', ["lara"]),
        ('x = "softmax" != name', ["softmax"]),
        ('ok = name not in ("rfa", "lara")', ["rfa", "lara"]),
        ('ok = name in ["eva", "other"]', ["eva"]),
        ('ok = name in {"scatterbrain"}', ["scatterbrain"]),
        ('ok = name in {"ra": 1, "x": 2}', ["ra"]),
        ('rows = table[table["estimator"] == "rfa"]', ["rfa"]),
        ('a < b == "local"', ["local"]),
        ('match name:\n    case "rfa" | "x":\n        pass', ["rfa"]),
    ],
)
def test_the_detector_finds_name_tests(source, names):
    (found,) = name_tests(source)
    assert found[2] == names


@pytest.mark.parametrize(
    "source",
    [
        'DEFAULT_ESTIMATORS = ("softmax", "rfa:coupling=orthogonal", "lara")',  # configuration, not a comparison
        'label = "rfa:coupling=orthogonal" == x',  # a label with parameters is not a bare name
        'ok = params.get("feature_map") == "trigonometric"',
        'spec = get_spec("rfa")',
        'ok = {"window": 4}.get("chunk_weight") == "exact"',
        'x = {"chunk_weight": "rfa"}',  # a parameter value in a dict literal, not compared
    ],
)
def test_the_detector_passes_what_is_not_a_name_test(source):
    assert name_tests(source) == []


def test_the_old_name_tests_would_be_found():
    """The name tests this rule replaced (plan.py, html.py, figures.py, tables.py before the protocol) fail it."""
    old = '''
class EstimatorConfig:
    @property
    def signed_weights(self):
        if self.name == "lara":
            return True
        return False

def _not_computed_reason(name, params):
    if name == "rfa" and params.get("feature_map") in ("trigonometric",):
        return "signed"
    if name not in ("rfa", "lara"):
        return "not defined"

def _rfa_variants(table):
    return table[table["estimator"] == "rfa"]
'''
    assert [line for line, _, _ in name_tests(old)] == [5, 10, 12, 16]


def test_analysis_reports_and_cli_never_test_an_estimator_name():
    offenders, used = [], set()
    for path in _modules():
        relative = path.relative_to(ROOT).as_posix()
        for line, text, names in name_tests(path.read_text(encoding="utf-8")):
            if (relative, text) in ALLOWED:
                used.add((relative, text))
                continue
            offenders.append(f"{relative}:{line}: {text}  (tests the name {', '.join(map(repr, names))})")
    assert not offenders, (
        "ask the estimator's spec (randattn.estimators.registry.get_spec(name): convergence_of, "
        "has_signed_weights, diagnostics_apply, needs_samples, params, ...) instead of testing its name, so that "
        "plugins are treated like built-ins; if the string is genuinely not an estimator name, add it to "
        "ALLOWED with the reason:\n  " + "\n  ".join(offenders)
    )
    stale = sorted(set(ALLOWED) - used)
    assert not stale, f"ALLOWED entries that match nothing any more (remove them): {stale}"
