r"""The rules of a sweep's output: what may replace, resume or refuse it, its manifest, and its lock.

ARCHITECTURE sec. 11, "store". The table, its parts and its metadata are :mod:`randattn.results`'; this module
rules a run around them. A parts folder (:func:`~randattn.results.parts_path`) holds, beside the parts,
``manifest.json``: the configuration and a fingerprint of the activations, checked when a run resumes
(:func:`prepare_parts_dir`). Resume = the planned units minus the stored unit ids
(:func:`~randattn.results.stored_unit_ids`).

A sweep's output is protected by a lock (:func:`sweep_lock`, an OS file lock): a second writer
is refused with :class:`SweepLockedError`, naming the process that holds it; the lock's files are
removed when it is released.

Every write error names the file the writer was asked for (not its temporary name), so that a
full disk (``ENOSPC``, ``EDQUOT``, ``EFBIG``) can be reported as that file and its cause.

An output table's whole life is ruled here too (:func:`check_output`): nothing finished is replaced without
``force``, ``resume`` continues the parts folder beside it (:func:`~randattn.results.parts_path`) or finds the
table complete. The rules raise typed errors (:class:`OutputExistsError`, :class:`ResumeMismatchError` and its
subclasses, :class:`OutputPathError`, :class:`PartsExistError`) that carry the facts -- the paths, what differs,
what is wrong -- as attributes, so ``randattn mse`` and a Python caller refuse alike and each words the remedy with
its own options (the command line in :mod:`randattn.cli._errors`).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from randattn._files import atomic_write_text, named_write_errors
from randattn.results.parts import parts_path  # the output's parts folder: the rules below act on it
from randattn.results.parts import stored_unit_ids as _stored_unit_ids
from randattn.results.table import OUTPUT_FORMATS as _OUTPUT_FORMATS
from randattn.results.table import positions_path, sidecar_path

__all__ = [
    "MANIFEST",
    "OutputRuleError",
    "OutputPathError",
    "OutputExistsError",
    "ResumeMismatchError",
    "FinishedRunMismatchError",
    "SettingsChangedError",
    "ManifestError",
    "PartsExistError",
    "parts_path",
    "check_output_path",
    "check_output",
    "check_manifest",
    "compare_manifest",
    "drop_empty_parts",
    "kept_message",
    "SweepLockedError",
    "sweep_lock",
    "prepare_parts_dir",
    "read_manifest",
]

MANIFEST = "manifest.json"

#: the names that moved to randattn.results (the table, its parts and its metadata): old name -> module there
_MOVED = {
    "CORRUPT_DIR": "parts", "CorruptPartWarning": "parts", "PART_WARNINGS_KEY": "parts",
    "stored_unit_ids": "parts", "unit_id_of": "parts", "write_part": "parts", "read_part_warnings": "parts",
    "read_parts": "parts", "read_position_parts": "parts", "unreadable_parts": "parts",
    "set_aside_unreadable": "parts", "coerce": "schema", "coerce_positions": "schema", "consolidate": "schema",
    "consolidate_positions": "schema", "empty_table": "schema", "empty_positions": "schema",
    "OUTPUT_FORMATS": "table",
}


def __getattr__(name: str) -> Any:
    """The names that moved to :mod:`randattn.results`, still answered here with a ``DeprecationWarning``."""
    if name in _MOVED:
        from importlib import import_module

        warnings.warn(f"randattn.analysis.store.{name} is deprecated: use randattn.results.{name} (the results "
                      "table, its parts and its metadata live in randattn.results)", DeprecationWarning, stacklevel=2)
        return getattr(import_module(f"randattn.results.{_MOVED[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class OutputRuleError(ValueError):
    """An output rule refuses the run: the base of the errors below. Each carries the facts as attributes and
    says them, with what a Python caller can do, in its message; ``randattn mse`` words the same facts with its
    own options (:mod:`randattn.cli._errors`)."""


class OutputPathError(OutputRuleError):
    """The output path cannot be a table: an unknown suffix, a folder, or a folder that cannot be written.

    Attributes
    ----------
    out : Path
        The output path asked for.
    problem : str
        What is wrong with it, as it follows the path in a sentence (:meth:`naming`).
    """

    def __init__(self, out: str | os.PathLike, problem: str) -> None:
        super().__init__(out, problem)
        self.out, self.problem = Path(out), problem

    def naming(self, subject: str) -> str:
        """The message with the output called ``subject`` (``"output 'r.csv'"``; a command line names its option)."""
        return f"{subject} {self.problem}" if self.problem.startswith("is ") else f"{subject}: {self.problem}"

    def __str__(self) -> str:
        return self.naming(f"output {str(self.out)!r}")


class OutputExistsError(OutputRuleError):
    """The output, or an unfinished run of it, exists and neither ``force`` nor ``resume`` allows continuing.

    Attributes
    ----------
    out : Path
        The output table.
    path : Path
        What exists: ``out`` itself, its parts folder (:func:`parts_path`) holding an unfinished run, or a file a
        run writes beside the table (its metadata, the per-position table) found without the table.
    unfinished : bool
        True when ``path`` is the parts folder of an unfinished run (``resume`` continues it), False when it is the
        finished table or a file beside it (``force`` replaces it).
    """

    def __init__(self, out: str | os.PathLike, path: str | os.PathLike, unfinished: bool) -> None:
        super().__init__(out, path, unfinished)
        self.out, self.path, self.unfinished = Path(out), Path(path), unfinished

    @property
    def what(self) -> str:
        """The fact, without what to do about it."""
        return f"{str(self.path)!r} holds an unfinished run" if self.unfinished else f"{str(self.path)!r} exists"

    def __str__(self) -> str:
        if self.unfinished:
            return f"{self.what}; resume=True continues it, force=True starts afresh"
        if self.path != self.out:  # a file written beside the table, which is not there
            return f"{self.what}; force=True replaces it"
        return f"{self.what}; force=True replaces it (resume=True checks it is complete)"


class ResumeMismatchError(OutputRuleError):
    """``resume`` cannot continue: the stored run has other settings, or its manifest is missing or damaged (the
    three subclasses below say which)."""


class FinishedRunMismatchError(ResumeMismatchError):
    """``resume`` on a finished table written with other settings.

    Attributes
    ----------
    out : Path
        The finished table.
    activations : tuple of str
        The activations' fingerprint keys that differ (empty: the settings differ).
    """

    def __init__(self, out: str | os.PathLike, activations: Sequence[str] = ()) -> None:
        super().__init__(out)
        self.out, self.activations = Path(out), tuple(activations)

    @property
    def what(self) -> str:
        """The fact, without what to do about it."""
        if self.activations:
            return (f"{str(self.out)!r} holds a finished run of other activations (their "
                    f"{', '.join(self.activations)})")
        return f"{str(self.out)!r} holds a finished run with different settings"

    def __str__(self) -> str:
        return f"{self.what}; force=True replaces it, or write another output"


class SettingsChangedError(ResumeMismatchError):
    """``resume`` on a parts folder started with other settings or other activations.

    Attributes
    ----------
    parts : Path
        The parts folder.
    settings : tuple of str
        The configuration's keys that differ from the stored ones.
    activations : tuple of str
        The activations' fingerprint keys that differ.
    """

    def __init__(self, parts: str | os.PathLike, settings: Sequence[str], activations: Sequence[str]) -> None:
        super().__init__(parts, tuple(settings), tuple(activations))
        self.parts, self.settings, self.activations = Path(parts), tuple(settings), tuple(activations)

    def __str__(self) -> str:
        what = []
        if self.settings:
            what.append(f"different settings ({', '.join(self.settings)})")
        if self.activations:
            what.append(f"other activations (their {', '.join(self.activations)})")
        return (f"cannot resume {str(self.parts)!r}: it was started with {' and '.join(what)}; "
                "use the same options and activations, or a new output")


class ManifestError(ResumeMismatchError):
    """The manifest of a parts folder holding finished units is missing, unreadable or not of its form, so the
    units cannot be checked against the run's settings.

    Attributes
    ----------
    parts : Path
        The parts folder.
    manifest : Path
        Its manifest file.
    problem : str
        What is wrong with it (``"is not valid JSON (...)"``).
    """

    def __init__(self, parts: str | os.PathLike, problem: str) -> None:
        super().__init__(parts, problem)
        self.parts, self.problem = Path(parts), problem
        self.manifest = self.parts / MANIFEST

    def __str__(self) -> str:
        return f"cannot resume {str(self.parts)!r}: its manifest {str(self.manifest)!r} {self.problem}"


class PartsExistError(FileExistsError):
    """A parts folder holds a sweep's finished units and the sweep was not asked to resume.

    Attributes
    ----------
    parts : Path
        The parts folder.
    resume_hint : str
        How the caller continues a run (``"resume=True"``), named in the message.
    """

    def __init__(self, parts: str | os.PathLike, resume_hint: str = "resume=True") -> None:
        super().__init__(parts, resume_hint)
        self.parts, self.resume_hint = Path(parts), resume_hint

    def __str__(self) -> str:
        return f"{str(self.parts)!r} already holds a sweep; pass {self.resume_hint} to continue it or remove the folder"


class SweepLockedError(RuntimeError):
    """Another process holds the lock of this sweep output.

    Attributes
    ----------
    target : Path
        The output (or parts folder) the lock protects.
    holder : str or None
        The process holding it (``"pid 12 on host, started ...: randattn mse ..."``), or None when the lock could
        not be taken because its file kept being removed (then ``lock`` names it).
    lock : Path or None
    """

    def __init__(self, target: str | os.PathLike, holder: str | None, lock: str | os.PathLike | None = None) -> None:
        super().__init__(target, holder, lock)
        self.target, self.holder = Path(target), holder
        self.lock = None if lock is None else Path(lock)

    @property
    def what(self) -> str:
        """The fact, without what to do about it."""
        if self.holder is None:
            return f"cannot take the lock {str(self.lock)!r}: it keeps being removed"
        return f"{str(self.target)!r} is being written by another randattn process ({self.holder})"

    def __str__(self) -> str:
        return self.what if self.holder is None else f"{self.what}; wait for it to finish, or write to another output"


# ------------------------------------------------------------------------------------------------------------ lock
def _lock_paths(target: Path) -> tuple[Path, Path]:
    return target.with_name(f".{target.name}.lock"), target.with_name(f".{target.name}.owner.json")


@contextmanager
def sweep_lock(target: str | os.PathLike) -> Iterator[None]:
    """Hold the lock of the sweep output ``target`` (a parts folder or table path) for the block.

    The lock is an OS lock (``flock``) on ``.<name>.lock`` beside ``target``, released when the
    process dies, even by SIGKILL; who holds it is written to ``.<name>.owner.json`` so a refused
    writer can say which process it is. Both files are removed when the block ends, however it
    ends (a SIGKILLed process leaves them; they are harmless: the next writer takes the lock over).

    Raises
    ------
    SweepLockedError
        Another process holds the lock.

    Notes
    -----
    Removing a lock file is safe only under two rules, which :func:`_hold_file_lock` keeps:

    1. the file is removed only by the process holding its lock, *before* it lets the lock go;
    2. a process that obtains the lock then checks that the file it locked is still the one at the path,
       and if not (its holder removed it between this process's ``open`` and ``flock``) it lets go and
       locks the file now at the path.

    Without rule 2, a process B could open the old file, its holder A remove it and release it, B lock
    the removed file and a process C create and lock a new one: two writers. With both rules, a process
    holds the lock only while the path names the very file it locked, and the path changes only after
    its holder's work is done, so at most one process at a time is inside the block.
    """
    target = Path(target)
    lock_path, owner_path = _lock_paths(target)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with named_write_errors(lock_path):
        release = _hold_file_lock(lock_path, target)
    if release is None:
        raise SweepLockedError(target, _owner(owner_path))
    try:
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                 "command": " ".join(sys.argv)}
        with named_write_errors(owner_path):
            atomic_write_text(owner_path, json.dumps(owner))
        yield
    finally:
        try:
            owner_path.unlink()
        except FileNotFoundError:
            pass
        release()


def _hold_file_lock(lock_path: Path, target: Path):
    """Lock ``lock_path`` (created if missing); a function that removes the file and releases the lock, or None
    when another process holds it. See :func:`sweep_lock` for why removing the file is safe."""
    try:
        import fcntl
    except ImportError:  # not a POSIX system: filelock's lock (Windows removes its file itself)
        return _hold_filelock(lock_path)
    for _ in range(100):  # each retry means the holder removed the file in between: the lock is free now
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError:  # a file system without flock
            os.close(fd)
            return _hold_filelock(lock_path)
        try:
            current = os.stat(lock_path)
        except FileNotFoundError:
            current = None
        if current is not None and os.path.samestat(os.fstat(fd), current):
            break
        os.close(fd)  # the file we locked was removed by its holder as it let go (rule 2)
    else:
        raise SweepLockedError(target, None, lock_path)

    def release() -> None:
        try:
            current = os.stat(lock_path)
            if os.path.samestat(os.fstat(fd), current):
                os.unlink(lock_path)  # rule 1: while still holding the lock
        except OSError:
            pass
        finally:
            os.close(fd)  # releases the lock

    return release


def _hold_filelock(lock_path: Path):
    """The ``filelock`` library's lock (systems without ``flock``); its file is left in place on such systems."""
    from filelock import FileLock, Timeout

    lock = FileLock(str(lock_path), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        return None
    return lock.release


def _owner(owner_path: Path) -> str:
    try:
        owner = json.loads(owner_path.read_text())
        return f"pid {owner['pid']} on {owner['host']}, started {owner['started']}: {owner['command']}"
    except (OSError, ValueError, KeyError):
        return "process unknown"


# ------------------------------------------------------------------------------------------------------------ manifest
def prepare_parts_dir(parts_dir: str | os.PathLike, manifest: Mapping[str, Any], resume: bool,
                      resume_hint: str = "resume=True") -> None:
    """Create ``parts_dir`` with its manifest, or check the stored manifest when resuming.

    A folder holding no part (a run stopped before its first unit finished) never blocks a
    new run: it is started afresh.

    Raises
    ------
    PartsExistError
        ``parts_dir`` holds parts and ``resume`` is False (a ``FileExistsError``).
    SettingsChangedError
        Resuming with settings or activations that differ from the stored ones (it names them).
    ManifestError
        Resuming parts whose manifest is missing or unreadable (it names the file and what is wrong).
    """
    parts_dir = Path(parts_dir)
    path = parts_dir / MANIFEST
    if _stored_unit_ids(parts_dir):
        if not resume:
            raise PartsExistError(parts_dir, resume_hint)
        compare_manifest(parts_dir, manifest)
        return
    with named_write_errors(parts_dir):
        parts_dir.mkdir(parents=True, exist_ok=True)
    with named_write_errors(path):
        atomic_write_text(path, json.dumps(manifest, indent=2, sort_keys=True, default=str))


def _changed_keys(old: Mapping[str, Any], new: Mapping[str, Any], part: str) -> list[str]:
    """The keys of ``part`` whose values differ; an activations ``digest`` counts only where both record one (parts
    and tables of a version without it stay resumable, unchecked in their numbers)."""
    stored, given = old.get(part) or {}, new.get(part) or {}
    keys = set(stored) | set(given)
    if part == "activations" and not ("digest" in stored and "digest" in given):
        keys.discard("digest")
    return sorted(key for key in keys if stored.get(key) != given.get(key))


def compare_manifest(parts_dir: str | os.PathLike, manifest: Mapping[str, Any]) -> None:
    """Raise :class:`SettingsChangedError` naming what differs between the stored manifest of ``parts_dir`` and
    ``manifest`` (the configuration's keys, the activations' fingerprint keys; a part given as None is not
    compared); ManifestError where it is damaged."""
    old = read_manifest(parts_dir)
    new = json.loads(json.dumps(manifest, default=str))  # the same JSON normal form as the stored one
    changed = {part: _changed_keys(old, new, part) if new.get(part) is not None else []
               for part in ("config", "activations")}
    if changed["config"] or changed["activations"]:
        raise SettingsChangedError(parts_dir, changed["config"], changed["activations"])


def read_manifest(parts_dir: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """The manifest of ``parts_dir``: ``{"config": {...}, "activations": {...}}``.

    Raises
    ------
    ManifestError
        It is missing, not JSON, or not of that form (a ``ValueError``); it names the file and what is wrong.
    """
    path = Path(parts_dir) / MANIFEST
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ManifestError(parts_dir, "is missing, so the finished units cannot be checked against these "
                                       "settings") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ManifestError(parts_dir, f"cannot be read ({exc})") from None
    try:
        manifest = json.loads(text)
    except ValueError as exc:
        raise ManifestError(parts_dir, f"is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict):
        raise ManifestError(parts_dir, f"holds a JSON {type(manifest).__name__}, not an object with 'config' and "
                                       "'activations'")
    bad = [key for key in ("config", "activations") if not isinstance(manifest.get(key), dict)]
    if bad:
        raise ManifestError(parts_dir, f"lacks {' and '.join(repr(k) for k in bad)} (expected objects)")
    return manifest


# ------------------------------------------------------------------------------------------------------------ output
def check_output_path(out: str | os.PathLike, *, look_only: bool = False) -> Path:
    """Check that ``out`` can name a table: its suffix (:data:`~randattn.results.OUTPUT_FORMATS`) and, with
    ``look_only``, that it is not a folder and its nearest existing folder is one this process can write to
    (without writing, as a dry run must).

    Raises
    ------
    OutputPathError
        It names the path and what is wrong.
    """
    out = Path(out)
    if out.suffix.lower() not in _OUTPUT_FORMATS:
        raise OutputPathError(out, f"unknown suffix {out.suffix!r}; use one of {', '.join(_OUTPUT_FORMATS)}")
    if not look_only:
        return out
    if out.is_dir():
        raise OutputPathError(out, "is a folder; give a file name")
    folder = next(p for p in [out.parent, *out.parent.parents] if p.exists() or p == Path(p.anchor))
    if not folder.is_dir():
        raise OutputPathError(out, f"{str(folder)!r} is a file, not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputPathError(out, f"cannot write to {str(folder)!r} (Permission denied)")
    return out


def check_manifest(parts: str | os.PathLike) -> None:
    """Check that the finished units of ``parts`` (if any) have a readable manifest.

    Raises
    ------
    ManifestError
        The manifest is missing or damaged; it names the file and what is wrong (``force`` starts afresh, and
        the finished units are lost).
    """
    if _stored_unit_ids(parts):
        read_manifest(parts)


def _stored_manifest(out: Path) -> dict[str, Any]:
    """The finished table's run as its sidecar records it: ``{"config": identity, "activations": fingerprint}``
    (either None where the sidecar is unreadable or predates it)."""
    try:
        stored = json.loads(sidecar_path(out).read_text())
    except (OSError, ValueError):
        return {"config": None, "activations": None}
    if not isinstance(stored, dict):
        return {"config": None, "activations": None}
    return {"config": stored.get("config_identity"), "activations": stored.get("activations_fingerprint")}


def check_output(out: str | os.PathLike, identity: Mapping[str, Any], *, resume: bool, force: bool,
                 dry_run: bool = False, activations: Mapping[str, Any] | None = None) -> bool:
    """Apply the rules for an existing output ``out`` (and its :func:`parts_path`) before a run writes it.

    Nothing finished is replaced without ``force``: an existing table refuses a plain run, as do the files a run
    writes beside it (its metadata, the per-position table and its metadata) found without it; ``resume`` on a
    finished table of the same settings does nothing, of other settings refuses; ``resume`` with an
    unreadable manifest refuses, naming it. A parts folder without a finished unit (a run stopped before its
    first) is removed, and with ``force`` (not in a dry run) the parts folder is removed: the run starts afresh.
    Call it holding :func:`sweep_lock` of ``out``. A dry run applies the same rules and changes nothing.

    Parameters
    ----------
    out : path
        The table.
    identity : mapping
        The run's ``SweepConfig.identity()``, compared with the one stored beside a finished table and, when
        resuming, with the parts' manifest (so that a refusal comes before anything is computed).
    resume, force, dry_run : bool
    activations : mapping, optional
        The activations' fingerprint (:func:`~randattn.analysis.records.activations_fingerprint`), compared
        likewise where given.

    Returns
    -------
    bool
        True when ``resume`` finds this very run already finished in ``out``: nothing is left to do.

    Raises
    ------
    OutputExistsError
        ``out`` or an unfinished run of it exists, and neither ``resume`` nor ``force`` is set.
    FinishedRunMismatchError
        ``resume`` on a finished table of other settings or other activations.
    SettingsChangedError
        ``resume`` on parts started with other settings or other activations.
    ManifestError
        ``resume`` on parts whose manifest is damaged.
    """
    out = Path(out)
    parts = parts_path(out)
    if parts.exists() and not _stored_unit_ids(parts) and not resume and not dry_run:
        shutil.rmtree(parts, ignore_errors=True)  # a run stopped before its first unit: nothing to keep
    if force:
        if not dry_run:
            shutil.rmtree(parts, ignore_errors=True)
        return False
    if _stored_unit_ids(parts):
        if not resume:
            raise OutputExistsError(out, parts, unfinished=True)
        compare_manifest(parts, {"config": identity, "activations": activations})
    if not out.exists():
        # the files a run writes beside its table, found without it: a run, resumed or not, would replace them
        beside = (sidecar_path(out), positions_path(out), sidecar_path(positions_path(out)))
        for companion in beside:
            if companion.exists():
                raise OutputExistsError(out, companion, unfinished=False)
    if out.exists():
        if not resume:
            raise OutputExistsError(out, out, unfinished=False)
        if parts.exists():
            return False  # a finished table beside an unfinished rerun: the parts decide
        stored = _stored_manifest(out)
        if stored["config"] != json.loads(json.dumps(identity)):
            raise FinishedRunMismatchError(out)
        given = json.loads(json.dumps({"activations": activations}, default=str))
        both = stored["activations"] is not None and activations is not None
        changed = _changed_keys(stored, given, "activations") if both else []
        if changed:
            raise FinishedRunMismatchError(out, changed)
        return True
    return False


def drop_empty_parts(parts: str | os.PathLike) -> None:
    """Remove a parts folder that holds no finished unit (only its manifest): there is nothing to resume."""
    if Path(parts).is_dir() and not _stored_unit_ids(parts):
        shutil.rmtree(parts, ignore_errors=True)


def kept_message(parts: str | os.PathLike | None, resume_command: str, then: str | None = None) -> str:
    """Deprecated: the command line's own (``randattn.cli._errors.kept_message``), which words its options; a
    Python caller asks :func:`stored_unit_ids` what a stopped run kept.

    What a failed run kept, to end its message; an empty parts folder is removed (:func:`drop_empty_parts`).
    """
    warnings.warn("randattn.analysis.store.kept_message is deprecated: what a stopped run kept is said by the command "
                  "line (randattn.cli._errors.kept_message); _stored_unit_ids(parts) tells a Python caller",
                  DeprecationWarning, stacklevel=2)
    if parts is None:
        return "; nothing was kept (no --out)"
    if _stored_unit_ids(parts):
        how = "" if then is None else f"; {then}, continue with: {resume_command}"
        return f"; finished units are kept in {parts} for --resume{how}"
    drop_empty_parts(parts)
    return "; nothing was kept (no unit had finished)"
