"""The conformance kit: hold any estimator, ours or yours, to the checks randattn's own pass.

>>> import randattn
>>> from randattn.testing import check_estimator
>>> report = check_estimator(randattn.get_spec("rfa"))   # raises EstimatorCheckError on a failure
>>> report.passed
True

In a pytest suite (one test per estimator and check, as scikit-learn's ``parametrize_with_checks``)::

    from randattn.testing import parametrize_with_checks
    from randattn_nystrom import SPEC

    @parametrize_with_checks([SPEC])
    def test_conformance(estimator, check):
        check(estimator)

The checks and their tolerances are in :mod:`randattn.testing.checks`; from the command line,
``randattn check NAME`` or ``randattn check MODULE:OBJECT`` runs them with a pass/fail table.
The comparison helpers of randattn's own tests (:func:`assert_close`, :data:`TOLERANCES`,
:func:`assert_close_to_rounding` for tables of metrics) live here too.
"""

from __future__ import annotations

import re

import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

from randattn.estimators.base import EstimatorSpec, SpecError, validate_spec
from randattn.testing._assert import (
    ROUNDING_FLOOR,
    TOLERANCES,
    all_variants,
    assert_close,
    assert_close_to_rounding,
    to_numpy,
    variant_id,
)
from randattn.testing.checks import CHECKS, CheckFailed, CheckSkipped, exact_on_check_inputs

__all__ = [
    "CHECKS",
    "CheckResult",
    "ConformanceReport",
    "EXACT_HERE_NOTE",
    "EstimatorCheckError",
    "ROUNDING_FLOOR",
    "SPEC_TARGETS",
    "SpecTargetError",
    "TOLERANCES",
    "all_variants",
    "assert_close",
    "assert_close_to_rounding",
    "check_estimator",
    "check_id",
    "load_spec",
    "parametrize_with_checks",
    "to_numpy",
    "variant_id",
]

STATUSES = ("passed", "failed", "skipped")


@dataclass(frozen=True)
class CheckResult:
    """One check on one configuration: ``status`` is ``passed``, ``failed`` or ``skipped``; ``message`` says why.

    ``error``: the exception an estimator raised inside the check (its message then says where it was raised), kept
    so that a test can chain it and show its traceback; None otherwise."""

    check: str
    status: str
    message: str = ""
    seconds: float = 0.0
    error: BaseException | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class ConformanceReport:
    """Every check's result for one estimator configuration."""

    estimator: str
    params: Mapping[str, Any]
    results: tuple[CheckResult, ...] = field(default_factory=tuple)
    #: what the results do not show: a configuration exact on every input of the checks (:data:`EXACT_HERE_NOTE`)
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def passed(self) -> bool:
        """True when no check failed (skipped checks do not apply)."""
        return not self.failures

    @property
    def failures(self) -> tuple[CheckResult, ...]:
        return tuple(r for r in self.results if r.status == "failed")

    def summary(self) -> str:
        """One line per check: status, name and, for failures and skips, why."""
        lines = [f"randattn conformance of {self.estimator!r} with {dict(self.params)}:"]
        for r in self.results:
            lines.append(f"  {r.status.upper():7s} {r.check}" + (f": {r.message}" if r.message else ""))
        lines.extend(f"  NOTE    {note}" for note in self.notes)
        return "\n".join(lines)


class EstimatorCheckError(AssertionError):
    """An estimator failed the conformance kit; ``report`` holds every result."""

    def __init__(self, report: ConformanceReport) -> None:
        self.report = report
        failed = ", ".join(r.check for r in report.failures)
        super().__init__(f"{len(report.failures)} check(s) failed ({failed})\n{report.summary()}")


#: the note of a configuration that returns exact softmax attention on every input of the checks
EXACT_HERE_NOTE = ("on the checks' inputs (64 keys at most) this configuration returns exact softmax attention "
                   "(1e-12): they did not exercise its approximation; check also a configuration whose budget "
                   "(sinks, window, top-k, samples) is below 64 keys")


#: what :func:`load_spec` accepts, for its messages
SPEC_TARGETS = ("a registered estimator name, or 'module:OBJECT' where OBJECT is an EstimatorSpec or a function of "
                "no arguments that returns one")


class SpecTargetError(ValueError):
    """A target that does not lead to an :class:`EstimatorSpec`.

    Attributes
    ----------
    target : str
        As given.
    got : str
        What it turned out to be, in words (``"a function, join, that needs arguments (a)"``).
    estimator, params : str or None, tuple of str
        For ``"name:param=value,..."`` (a registered estimator with parameters, as ``randattn mse -e`` writes
        it): the name and the ``param=value`` items, which go to ``check_estimator``'s ``params`` instead.
    """

    def __init__(self, target: str, got: str, *, estimator: str | None = None, params: Sequence[str] = ()) -> None:
        self.target, self.got, self.estimator, self.params = target, got, estimator, tuple(params)
        wants = ("the estimator's name alone, with its parameters given apart" if estimator is not None
                 else SPEC_TARGETS)
        super().__init__(f"{target!r} is {got}; expected {wants}")


def _needed_arguments(obj: Any) -> list[str] | None:
    """The parameters ``obj()`` would miss, or None when its signature cannot be read."""
    import inspect

    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    return [p.name for p in signature.parameters.values()
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def load_spec(target: str | EstimatorSpec) -> EstimatorSpec:
    """A spec from a registered name, ``"module:OBJECT"`` (an EstimatorSpec or a function of no arguments
    returning one), or itself.

    Raises :class:`SpecTargetError` (a ValueError) saying what the target is and what is wanted when it does not
    lead to a spec: a module, a class, a function that needs arguments or returns something else, or
    ``"name:param=value"`` (an estimator with parameters; give the parameters apart). An unknown name or a module
    that cannot be imported raises ValueError naming it.
    """
    if isinstance(target, EstimatorSpec):
        return target
    if not isinstance(target, str):
        raise TypeError(f"expected an estimator name, 'module:OBJECT' or an EstimatorSpec, got {type(target).__name__}")
    if ":" not in target:
        from randattn.estimators.registry import get_spec

        return get_spec(target)
    import importlib

    from randattn.estimators.registry import list_estimators

    module_name, _, attr = target.partition(":")
    items = [item.strip() for item in attr.split(",") if item.strip()]
    # no object name holds "="; a registered name before ":" that is no module is the same -e form
    if "=" in attr or (module_name in list_estimators() and _find_module(module_name) is None):
        raise SpecTargetError(target, f"the estimator {module_name!r} with parameters {', '.join(items)}",
                              estimator=module_name, params=items)
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:
        # a module not found is most often a folder not on the path: say which path Python searched first
        hint = (" (the randattn command does not search the current folder: run it there with PYTHONPATH=., "
                "or install the module's package)"
                if isinstance(exc, ModuleNotFoundError) and exc.name == module_name.split(".")[0] else "")
        raise ValueError(f"cannot import module {module_name!r} of {target!r}: {type(exc).__name__}: {exc}{hint}"
                         ) from None
    for part in filter(None, attr.split(".")):
        if not hasattr(obj, part):
            raise ValueError(f"module {module_name!r} has no attribute {attr!r} (from {target!r})")
        obj = getattr(obj, part)
    if isinstance(obj, EstimatorSpec):
        return obj
    if isinstance(obj, type):
        raise SpecTargetError(target, f"a class ({obj.__qualname__}), not an EstimatorSpec instance")
    if callable(obj):
        name = getattr(obj, "__qualname__", type(obj).__name__)
        needed = _needed_arguments(obj)
        if needed:
            raise SpecTargetError(target, f"a function, {name}, that needs arguments ({', '.join(needed)})")
        try:
            made = obj()
        except Exception as exc:  # whatever the call raised, the user hears it as what the target is
            raise SpecTargetError(target, f"a function, {name}, whose call raised {type(exc).__name__}: {exc}") from None
        if not isinstance(made, EstimatorSpec):
            raise SpecTargetError(target, f"a function, {name}, that returned a {type(made).__name__}, not an "
                                          "EstimatorSpec")
        return made
    kind = type(obj).__name__
    what = "a module" if isinstance(obj, type(importlib)) else f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"
    raise SpecTargetError(target, f"{what}, not an EstimatorSpec")


def _find_module(name: str) -> Any:
    import importlib.util

    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


def _run_check(name: str, spec: EstimatorSpec, params: Mapping[str, Any]) -> CheckResult:
    start = time.perf_counter()
    if name != "spec is valid":
        # an invalid spec (a parameter named ``k``, say) makes every other check fail for that one reason, under
        # words that blame something else: they are skipped, and "spec is valid" says what to fix
        try:
            validate_spec(spec)
        except SpecError:
            return CheckResult(name, "skipped", "the spec is invalid (see the check 'spec is valid')",
                               time.perf_counter() - start)
    try:
        CHECKS[name](spec, params)
    except CheckSkipped as exc:
        return CheckResult(name, "skipped", str(exc), time.perf_counter() - start)
    except CheckFailed as exc:
        return CheckResult(name, "failed", str(exc), time.perf_counter() - start)
    except Exception as exc:  # an estimator that crashes fails the check it crashed in, with the reason and where
        return CheckResult(name, "failed", f"raised {type(exc).__name__}: {exc} ({_raised_at(exc)})",
                           time.perf_counter() - start, error=exc)
    return CheckResult(name, "passed", "", time.perf_counter() - start)


#: the packages whose frames are not where an estimator's fault lies: the kit itself and the array libraries an
#: estimator calls (a shape error surfaces inside numpy or torch, but the line to change is the caller's)
_LIBRARY_PARTS = (("randattn", "testing"), ("numpy",), ("torch",), ("scipy",))


def _raised_at(exc: BaseException) -> str:
    """``"at FILE:LINE in FUNCTION"``: the innermost frame of ``exc``'s traceback outside the kit and the array
    libraries (the innermost frame of all where every frame is theirs)."""
    import traceback
    from pathlib import PurePath

    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "at an unknown place"

    def in_library(frame: traceback.FrameSummary) -> bool:
        parts = PurePath(frame.filename).parts
        return any(parts[i:i + len(lib)] == lib for lib in _LIBRARY_PARTS for i in range(len(parts)))

    outside = [frame for frame in frames if not in_library(frame)]
    frame = (outside or frames)[-1]
    return f"at {frame.filename}:{frame.lineno} in {frame.name}"


def check_estimator(
    estimator: str | EstimatorSpec,
    params: Mapping[str, Any] | None = None,
    *,
    checks: Sequence[str] | None = None,
    raise_on_failure: bool = True,
) -> ConformanceReport:
    """Run the conformance checks on one estimator configuration.

    Parameters
    ----------
    estimator : str or EstimatorSpec
        A registered name, ``"module:OBJECT"``, or a spec (registered or not).
    params : mapping, optional
        The configuration (defaults filled in by the spec); default: the spec's defaults.
    checks : sequence of str, optional
        Names from :data:`CHECKS`; default all.
    raise_on_failure : bool
        Raise :class:`EstimatorCheckError` (with the whole report) when a check fails.

    Returns
    -------
    ConformanceReport
    """
    spec = load_spec(estimator)
    names = list(CHECKS) if checks is None else list(checks)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise ValueError(f"unknown check(s) {unknown}; the checks are: {', '.join(CHECKS)}")
    raised: list[warnings.WarningMessage] = []
    try:
        resolved = spec.resolve_params(params or {})
    except (TypeError, ValueError) as exc:
        results: tuple[CheckResult, ...] = (CheckResult("spec is valid", "failed", str(exc)),)
        resolved = dict(params or {})
    else:
        with warnings.catch_warnings(record=True) as raised:
            warnings.simplefilter("always")
            results = tuple(_run_check(name, spec, resolved) for name in names)
    valid = all(r.status != "failed" for r in results if r.check == "spec is valid")
    notes = (EXACT_HERE_NOTE,) if valid and exact_on_check_inputs(spec, resolved) else ()
    notes += runtime_warning_notes(raised)
    report = ConformanceReport(spec.name, resolved, results, notes)
    if raise_on_failure and not report.passed:
        raise EstimatorCheckError(report)
    return report


#: how many distinct RuntimeWarnings a report notes (the most frequent), so that a noisy estimator's report stays short
RUNTIME_WARNING_NOTES = 3


def runtime_warning_notes(raised: Iterable[warnings.WarningMessage]) -> tuple[str, ...]:
    """The report's notes on the plain runtime warnings raised while the checks ran (numpy's overflow, division
    by zero, invalid value; randattn's own warnings are subclasses and not noted): each message with how often and
    where it was first raised, the most frequent :data:`RUNTIME_WARNING_NOTES`. randattn's estimators raise none on
    the checks' inputs; a check can pass on an output such a warning did not spoil, so it is said, not failed."""
    counts: dict[str, list[Any]] = {}
    for warning in raised:
        if warning.category is RuntimeWarning:
            seen = counts.setdefault(str(warning.message), [0, f"{warning.filename}:{warning.lineno}"])
            seen[0] += 1
    ranked = sorted(counts.items(), key=lambda item: -item[1][0])[:RUNTIME_WARNING_NOTES]
    return tuple(f"the estimator raised RuntimeWarning {message!r} {count} time{'s' * (count != 1)} during the "
                 f"checks (first at {where}): randattn's estimators raise none on these inputs; compute in log "
                 "space, or under numpy.errstate where an overflow or a log(0) is meant"
                 for message, (count, where) in ranked)


class _Check:
    """One conformance check bound to a configuration, callable as ``check(estimator)`` in a pytest test."""

    def __init__(self, name: str, params: Mapping[str, Any]) -> None:
        self.name = name
        self.params = dict(params)

    def __call__(self, estimator: EstimatorSpec) -> None:
        import pytest

        spec = load_spec(estimator)
        result = _run_check(self.name, spec, spec.resolve_params(self.params))
        if result.status == "skipped":
            pytest.skip(result.message)
        if result.status == "failed":  # chained to what the estimator raised, whose traceback pytest then shows
            raise AssertionError(f"{spec.name}: check {self.name!r} failed: {result.message}") from result.error

    def __repr__(self) -> str:
        return f"check[{self.name}]"


def parametrize_with_checks(
    estimators: Iterable[str | EstimatorSpec | tuple[str | EstimatorSpec, Mapping[str, Any]]],
    *,
    checks: Sequence[str] | None = None,
    expected_failures: Callable[[EstimatorSpec, Mapping[str, Any]], Mapping[str, str]] | None = None,
) -> Any:
    """A ``pytest.mark.parametrize`` over (estimator, check): one test per estimator configuration and check.

    The decorated test takes ``estimator`` (the spec) and ``check`` and calls ``check(estimator)``;
    a check that does not apply is reported as skipped, with its reason.

    Parameters
    ----------
    estimators : iterable
        Names, specs, or ``(name or spec, params)`` pairs for configurations other than the defaults.
    checks : sequence of str, optional
        Names from :data:`CHECKS`; default all.
    expected_failures : callable, optional
        ``expected_failures(spec, params) -> {check: reason}``: checks a configuration is known to fail (as
        scikit-learn's ``expected_failed_checks``); each is marked ``xfail(strict=True)`` with the reason, so that
        the suite stays green while the defect is open and fails once it is fixed (then drop the entry).
    """
    import pytest

    names = list(CHECKS) if checks is None else list(checks)
    cases = []
    for item in estimators:
        target, params = item if isinstance(item, tuple) else (item, {})
        spec = load_spec(target)
        known = dict(expected_failures(spec, params)) if expected_failures is not None else {}
        unknown = sorted(set(known) - set(CHECKS))
        if unknown:
            raise ValueError(f"expected_failures names unknown check(s) {unknown}; the checks are: {', '.join(CHECKS)}")
        suffix = "" if not params else "[" + "+".join(f"{k}:{v}" for k, v in params.items()) + "]"
        for name in names:
            marks = [pytest.mark.xfail(strict=True, reason=known[name])] if name in known else []
            cases.append(pytest.param(spec, _Check(name, params), id=check_id(f"{spec.name}{suffix}", name),
                                      marks=marks))
    return pytest.mark.parametrize(("estimator", "check"), cases)


def check_id(configuration: str, check: str) -> str:
    """The pytest id of a check of a configuration, ``<configuration>-<check>``, written only with what ``pytest -k``
    reads as a name (letters, digits, ``_ - . : + [ ]``), so that any part of it selects: ``==`` reads ``eq``, and
    every other run of other characters (a space, parentheses, ``=``, ``,``) one ``_``.

    >>> check_id("rfa[coupling:orthogonal]", "reference == batched (float64)")
    'rfa[coupling:orthogonal]-reference_eq_batched_float64'
    """
    words = re.sub(r"[^\w.:+\[\]-]+", "_", f"{configuration}-{check.replace('==', 'eq')}")
    return words.strip("_")
