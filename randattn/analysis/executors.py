r"""Executors: where a sweep's units run (ARCHITECTURE sec. 11, "execute").

An executor only maps units to :meth:`UnitRunner.run <randattn.analysis.execute.UnitRunner.run>`
and hands back each unit's rows as it finishes; it does not know what a unit computes.

- ``local``: in this process, one unit after another.
- ``processes:N``: a ``distributed.LocalCluster`` of N single-threaded worker processes here.
- ``tcp://HOST:PORT`` (or a ``distributed.Client``): a running Dask scheduler and its workers.

With Dask, workers read their inputs from the activation file **by path** (so the file must be
reachable by every worker: a shared filesystem, or the same path on each machine), each worker
process loading it once and keeping it for its next units; a unit's rows (and its per-position
rows) go to its Parquet parts written atomically by the worker itself when the sweep has a parts
folder, and come back to the client (a few rows a unit) for the progress bar and the in-memory table. A worker that dies
mid-unit loses only that unit, which Dask runs again elsewhere (``retries``); an error raised by a
unit (bad input) cancels the rest and is raised in the client with the unit's message, the parts
written so far staying on disk for ``--resume``. Rows depend only on the unit, the master seed
and the inputs, so the consolidated table is the same whatever the executor, the number of
workers and the order units finish in.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

__all__ = ["Scheduler", "SchedulerError", "parse_scheduler", "dask_client", "run_units_dask", "UNIT_RETRIES"]

#: times Dask re-runs a unit that raised an unexpected error (e.g. a flaky shared filesystem); a worker that dies
#: is handled by the scheduler itself (``distributed.scheduler.allowed-failures``), and an input error
#: (ValueError / TypeError) fails the run at once, since running it again gives the same error
UNIT_RETRIES = 2


class SchedulerError(ValueError):
    """A scheduler that cannot be used: not understood, without workers, unreachable, or Dask is not installed.

    Attributes
    ----------
    scheduler : str or None
        The scheduler as given (``"processes:0"``, an address), or None where Dask itself is missing.
    rest : str
        The sentence after the scheduler's name (:meth:`naming`): ``" 'threads:2' is not understood; use ..."``.
    """

    def __init__(self, scheduler: str | None, rest: str) -> None:
        super().__init__(scheduler, rest)
        self.scheduler, self.rest = scheduler, rest

    def naming(self, subject: str) -> str:
        """The message with the scheduler option called ``subject`` (``"scheduler"``; a command line its flag)."""
        return subject + self.rest

    def __str__(self) -> str:
        return self.naming("scheduler")


@dataclass(frozen=True)
class Scheduler:
    """A parsed scheduler (``run_sweep(scheduler=...)``, ``randattn mse --scheduler``): ``kind`` is ``"local"``,
    ``"processes"`` (with ``workers``) or ``"address"``."""

    kind: str
    workers: int = 0
    address: str = ""


def parse_scheduler(text: Any) -> Scheduler:
    """``"local"``, ``"processes:N"`` or ``"tcp://HOST:PORT"`` (any Dask address) -> :class:`Scheduler`.

    Raises
    ------
    SchedulerError
        Anything else, with the accepted forms (a ``ValueError``).
    """
    if text is None or text == "local":
        return Scheduler("local")
    text = str(text).strip()
    match = re.fullmatch(r"processes:(\d+)", text)
    if match:
        workers = int(match.group(1))
        if workers < 1:
            raise SchedulerError(text, f" {text!r}: needs at least 1 worker process")
        return Scheduler("processes", workers=workers)
    if re.fullmatch(r"(tcp|tls|inproc|ucx|ws|wss)://\S+", text):
        return Scheduler("address", address=text)
    raise SchedulerError(text, f" {text!r} is not understood; use local, processes:N or tcp://HOST:PORT")


@contextmanager
def dask_client(scheduler: Scheduler, *, threads: int | None = None, device: str | None = None) -> Iterator[Any]:
    """A ``distributed.Client`` for ``scheduler`` (a LocalCluster is started and closed here for ``processes``).

    Local workers are processes with one Dask thread each, whose BLAS/OpenMP pools get ``threads``
    threads (default 1), so that they do not oversubscribe the cores. torch's count is set per unit from the
    sweep's configuration in every process, but numpy's BLAS pool in the command itself keeps its size (all cores
    unless ``OMP_NUM_THREADS`` says otherwise), and OpenBLAS rounds a product differently at another thread count:
    the float64 reference check (``ref_rms_dev``) then differs in its last bits (1.5e-12 relative measured) between
    the workers and an in-process run, unless that run is started with ``OMP_NUM_THREADS`` equal to ``threads``.
    Workers of a running scheduler should be started with that ``OMP_NUM_THREADS`` too. ``device`` is passed for
    documentation only: with ``--device cuda`` run one worker per GPU, e.g. with ``dask_cuda.LocalCUDACluster``
    (which sets ``CUDA_VISIBLE_DEVICES`` per worker) and ``--scheduler`` pointing at its address.
    """
    try:
        from distributed import Client, LocalCluster
    except ImportError:  # pragma: no cover - depends on the install
        raise SchedulerError(None, " needs Dask: pip install 'randattn[distributed]'") from None
    if scheduler.kind == "processes":
        n = str(int(threads or 1))
        env = {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "OPENBLAS_NUM_THREADS": n}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # port-in-use notices for the dashboard
            cluster = LocalCluster(n_workers=scheduler.workers, threads_per_worker=1, processes=True,
                                   dashboard_address=":0", env=env, silence_logs=logging.ERROR)
        try:
            with Client(cluster) as client:
                yield client
        finally:
            cluster.close()
    elif scheduler.kind == "address":
        try:
            client = Client(scheduler.address, timeout="10s")
        except (OSError, TimeoutError) as exc:
            raise SchedulerError(scheduler.address,
                                 f" {scheduler.address}: cannot reach a Dask scheduler there ({exc})") from None
        with client:
            yield client
    else:
        raise ValueError("dask_client needs a processes:N or address scheduler")


# ---------------------------------------------------------------------------------------------------- worker side
@functools.lru_cache(maxsize=4)
def _worker_runner(path: str, mtime_ns: int, config_key: str, config):
    """One UnitRunner per (file, configuration) per worker process: the file is read once, not per unit."""
    from randattn.activations import load_activations
    from randattn.analysis.execute import UnitRunner

    with warnings.catch_warnings():
        # the client read the same file to plan and said its warnings once, in its own words; a worker that said
        # them again would print them in Python's format (file, line, source) once per process
        warnings.simplefilter("ignore")
        activations = load_activations(path)
    return UnitRunner(activations, config)


def _run_unit_in_worker(path: str, config, config_key: str, unit, parts_dir: str | None, specs=()):
    """The task Dask runs: rows of ``unit``, written as its part when there is a parts folder.

    ``specs``: estimators the client registered for its session only (entry-point plugins the worker
    discovers itself, as the client did).
    """
    from randattn._process import retain_freed_memory
    from randattn.results.parts import write_part
    from randattn.analysis.execute import run_recording
    from randattn.estimators.registry import ensure_registered

    try:
        ensure_registered(specs)
        runner = _worker_runner(path, os.stat(path).st_mtime_ns, config_key, config)
        # a worker process is ours to configure, as the CLI's is: freed memory kept for a unit that runs whole, given
        # back for one split to fit max_memory, whose budget it would exceed (randattn._process)
        retain_freed_memory(runner.canonical(unit))
        rows, caught, seconds, positions = run_recording(runner, unit)
    except (ValueError, TypeError) as exc:  # deterministic: report, do not retry
        return unit.uid, exc, [], {}, None
    if parts_dir is not None:
        write_part(parts_dir, unit.uid, rows, positions, caught, seconds)  # its warnings and times live with its rows
    return unit.uid, rows, caught, seconds, positions


# ---------------------------------------------------------------------------------------------------- client side
def run_units_dask(
    client: Any, path: str | os.PathLike, config, units: Sequence[Any], parts_dir: str | os.PathLike | None,
    *, retries: int = UNIT_RETRIES, on_done: Callable[[Any, list, list, dict, Any], None] | None = None,
) -> None:
    """Run ``units`` on the Dask ``client``'s workers; call ``on_done(unit, rows, warnings, seconds, positions)`` as
    each finishes.

    ``seconds``: the unit's wall time per phase on its worker (:meth:`~randattn.analysis.execute.UnitRunner.run_timed`);
    ``positions``: its per-position rows, or None.

    Raises
    ------
    Exception
        The first error a unit raised (after its retries), with the other units cancelled; the
        parts already written stay.
    """
    from distributed import as_completed

    from randattn.estimators.registry import session_specs

    path = os.path.abspath(os.fspath(path))
    parts = None if parts_dir is None else os.path.abspath(os.fspath(parts_dir))
    config_key = repr(config.identity())
    specs = tuple(session_specs(sorted({e.name for e in config.estimators})))
    by_key = {}
    futures = []
    for unit in units:
        future = client.submit(_run_unit_in_worker, path, config, config_key, unit, parts, specs,
                               key=f"randattn-{unit.uid}", retries=retries, pure=False)
        by_key[future.key] = unit
        futures.append(future)
    try:
        for future in as_completed(futures):
            if future.status == "error":
                raise future.exception()
            _, rows, caught, seconds, positions = future.result()
            if isinstance(rows, BaseException):
                raise rows
            if on_done is not None:
                on_done(by_key[future.key], rows, caught, seconds, positions)
    except BaseException:
        client.cancel(futures)
        raise
