"""Sweeps on Dask: the same table as in-process, resume across executors, a killed worker, a failing unit."""

from __future__ import annotations

import os
import signal

import numpy as np
import pandas as pd
import pytest

distributed = pytest.importorskip("distributed")

from click.testing import CliRunner  # noqa: E402

from randattn.activations import make_activations, save_activations  # noqa: E402
from randattn.analysis.executors import parse_scheduler  # noqa: E402
from randattn.analysis.sweep import SweepConfig, parse_estimator_list, read_parts, run_sweep  # noqa: E402


@pytest.fixture(scope="module")
def client():
    """One 2-process LocalCluster for the module (starting one costs seconds)."""
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                                  silence_logs=40) as cluster, distributed.Client(cluster) as c:
        yield c


@pytest.fixture(scope="module")
def acts_path(tmp_path_factory):
    rng = np.random.default_rng(7)
    arrays = {layer: tuple(rng.normal(size=(2, 2, 40, 8)) for _ in range(3)) for layer in (0, 1, 2)}
    acts = make_activations(arrays, {"scale": 0.3, "model": "synthetic", "images": ["cat", "dog"]})
    return save_activations(acts, tmp_path_factory.mktemp("dask") / "acts.safetensors")


def _config(**kw):
    base = dict(estimators=parse_estimator_list("rfa:coupling=orthogonal;lara:weighting=balance;ra"),
                num_samples=(4, 16), replicates=4, seed=5, khat_queries=4)
    base.update(kw)
    return SweepConfig(**base)


def _same(a, b):
    pd.testing.assert_frame_equal(a.drop(columns="seconds"), b.drop(columns="seconds"), check_exact=True)


@pytest.fixture(scope="module")
def local_table(acts_path):
    return run_sweep(acts_path, _config())


def test_parse_scheduler():
    assert parse_scheduler("local").kind == "local" and parse_scheduler(None).kind == "local"
    assert parse_scheduler("processes:3").workers == 3
    assert parse_scheduler("tcp://10.0.0.1:8786").address == "tcp://10.0.0.1:8786"
    for bad in ("processes:0", "processes", "threads:2", "http://x"):
        with pytest.raises(ValueError, match=f"^scheduler '{bad}'") as raised:
            parse_scheduler(bad)
        assert raised.value.scheduler == bad and "--" not in str(raised.value)


@pytest.mark.slow  # a Dask cluster, ~9 s on 2 cores; CI runs the plugin example on Dask workers after the suite
def test_dask_table_is_identical_to_local(acts_path, client, local_table, tmp_path):
    table = run_sweep(acts_path, _config(), scheduler=client, parts_dir=tmp_path / "parts")
    _same(local_table, table)
    # every unit's part was written by a worker, atomically (no temporary files left)
    assert len(list((tmp_path / "parts").glob("part-*.parquet"))) == 3 * 2 * 3 * 2 - 0  # layers x S x configs x images
    assert not list((tmp_path / "parts").glob(".*.tmp"))
    # the workers' phase timings come back with the rows: every unit counted once
    phases = table.attrs["timing"]["phases"]
    assert sum(p["units"] for p in phases) == table.attrs["timing"]["units"] == 3 * 2 * 3 * 2


@pytest.mark.slow  # ~4 s; the default run keeps Dask's table against the local one (scheduler address)
def test_resumed_dask_run_equals_uninterrupted_local_run(acts_path, client, local_table, tmp_path):
    seen = []

    def stop(progress):
        seen.append(progress)
        if len(seen) == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_sweep(acts_path, _config(), scheduler=client, parts_dir=tmp_path / "p", progress=stop)
    kept = read_parts(tmp_path / "p")
    assert 0 < len(kept) < len(local_table)
    _same(local_table, run_sweep(acts_path, _config(), scheduler=client, parts_dir=tmp_path / "p", resume=True))


@pytest.mark.slow  # a Dask run between two local ones, ~10 s on 2 idle cores
def test_warnings_raised_on_workers_are_stored_with_their_parts_and_survive_resume(acts_path, client, tmp_path):
    """A unit's warnings travel with its part, whoever wrote it: a local resume of a Dask run reports what the
    workers' units raised, as an uninterrupted local run does."""
    config = _config(estimators=parse_estimator_list("rfa:feature_map=trigonometric"), num_samples=(4,), images=(0,))
    with pytest.warns(RuntimeWarning):
        local = run_sweep(acts_path, config).attrs["warnings"]
    assert local and local[0]["units"] == 3  # every layer's unit raises it
    seen = []

    def stop(progress):
        seen.append(progress)
        if len(seen) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_sweep(acts_path, config, scheduler=client, parts_dir=tmp_path / "p", progress=stop)
    with pytest.warns(RuntimeWarning):
        resumed = run_sweep(acts_path, config, parts_dir=tmp_path / "p", resume=True)
    assert resumed.attrs["timing"]["units"] < 3  # the workers' parts were not computed again
    assert resumed.attrs["warnings"] == local


@pytest.mark.slow  # over 6 s on the 2-core machine: in the slow target
def test_a_worker_killed_mid_run_loses_only_its_unit(acts_path, client, local_table):
    pids = client.run(os.getpid)
    killed = []

    def kill_one(progress):
        if not killed:
            victim = sorted(pids.values())[0]
            os.kill(victim, signal.SIGKILL)
            killed.append(victim)

    table = run_sweep(acts_path, _config(), scheduler=client, progress=kill_one)
    assert killed
    _same(local_table, table)
    client.wait_for_workers(2, timeout=60)
    assert killed[0] not in client.run(os.getpid).values()  # the nanny started a new worker process


def _fail_layer_one(dask_worker=None):
    from randattn.analysis import execute

    original = execute.UnitRunner.run_timed  # what the executors call

    def run_timed(self, unit):
        if unit.layer == 1:
            raise ValueError(f"bad input in layer {unit.layer}")
        return original(self, unit)

    execute.UnitRunner.run_timed = run_timed


def _restore(dask_worker=None):
    import importlib

    from randattn.analysis import execute

    importlib.reload(execute)


@pytest.mark.slow  # 10 s on the 2-core machine (a Dask cluster and a failing worker): in the slow target
def test_a_failing_unit_fails_the_run_with_its_message_and_keeps_finished_parts(acts_path, client, tmp_path):
    from randattn.cli import main

    client.run(_fail_layer_one)
    try:
        with pytest.raises(ValueError, match="bad input in layer 1"):
            run_sweep(acts_path, _config(), scheduler=client, parts_dir=tmp_path / "p")
        # the CLI through a running scheduler: exit 2 with the unit's message; finished parts stay for --resume
        out = tmp_path / "cli.parquet"
        result = CliRunner().invoke(main, ["mse", str(acts_path), "-e", "rfa", "--samples", "4", "--replicates", "3",
                                           "--scheduler", client.scheduler.address, "--out", str(out)])
        assert result.exit_code == 2, result.output
        assert "bad input in layer 1" in result.output
        assert not out.exists()
    finally:
        client.run(_restore)


# ~9 s, a second Dask run through the CLI: the default run keeps the Dask table's identity
# (test_dask_table_is_identical_to_local) and the flag's parsing (test_parse_scheduler)
@pytest.mark.slow
def test_cli_scheduler_address_gives_the_local_table(acts_path, client, tmp_path):
    from randattn.cli import main

    args = ["mse", str(acts_path), "-e", "rfa:coupling=orthogonal", "--samples", "4", "--replicates", "3"]
    local = tmp_path / "local.parquet"
    remote = tmp_path / "remote.parquet"
    assert CliRunner().invoke(main, [*args, "--out", str(local)]).exit_code == 0
    result = CliRunner().invoke(main, [*args, "--out", str(remote), "--scheduler", client.scheduler.address])
    assert result.exit_code == 0, result.output
    assert "Dask: 2 workers" in result.output
    _same(pd.read_parquet(local), pd.read_parquet(remote))
    bad = CliRunner().invoke(main, [*args, "--scheduler", "nonsense"])
    assert bad.exit_code == 2 and "--scheduler 'nonsense' is not understood" in bad.output


@pytest.mark.slow  # two randattn processes and a LocalCluster: about 15 s
def test_an_in_process_run_under_omp_threads_equal_to_threads_is_the_dask_workers_table_bit_for_bit(tmp_path):
    """numpy's BLAS pool in the command keeps its size while the local workers' get --threads: OpenBLAS rounds the
    float64 reference check's products apart (ref_rms_dev, 197 tokens x 64 dims, S = 64). docs/guide/sweeps.md
    says to compare under OMP_NUM_THREADS equal to --threads: then every column is equal, bit for bit."""
    import subprocess
    import sys

    rng = np.random.default_rng(5)
    arrays = {0: tuple(rng.standard_normal((1, 2, 197, 64)).astype(np.float32) for _ in range(3))}
    source = save_activations(make_activations(arrays, {"model": "synthetic", "scale": 0.125, "images": ["x"],
                                                        "layout": "sequence"}), tmp_path / "s.safetensors")
    args = ["-e", "rfa", "--samples", "64", "--replicates", "4", "--threads", "1", "--seed", "7", "--heads", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for out, extra in (("local.parquet", []), ("dask.parquet", ["--scheduler", "processes:1"])):
        done = subprocess.run([sys.executable, "-c", "from randattn.cli import main; main()", "mse", str(source), *args,
                               *extra, "--out", str(tmp_path / out)], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
    local, dask = (pd.read_parquet(tmp_path / name).drop(columns="seconds") for name in ("local.parquet",
                                                                                          "dask.parquet"))
    pd.testing.assert_frame_equal(local, dask, check_exact=True)
    assert np.isfinite(local["ref_rms_dev"]).any()
