"""The library raises facts, the command line words them: each typed refusal of the sweep's store and memory model
says its remedy to a Python caller without a command-line option, carries the facts as attributes (that survive a
pickle, as a Dask worker's error does), and ``randattn``'s words for it -- with its options -- come from its type
(:func:`randattn.cli._errors.said`). The end-to-end texts are pinned by tests/cli/test_faults.py,
test_newcomer_mse.py and test_mse.py; here each error is raised by the library function that raises it."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from randattn.analysis import store
from randattn.analysis.cell_memory import MemoryBudgetError, check_fits
from randattn.cli._errors import said


def _with_a_finished_unit(parts: Path) -> Path:
    """``parts`` holding one finished unit (its file name is what makes it one) and a manifest."""
    store.prepare_parts_dir(parts, {"config": {"seed": 1}, "activations": {}}, resume=False)
    (parts / "part-L0-a.parquet").write_bytes(b"")
    return parts


def _raised(call) -> BaseException:
    with pytest.raises(Exception) as raised:
        call()
    exc = raised.value
    quoted = getattr(exc, "holder", None) or ""  # a lock's holder is quoted with its command line
    assert "--" not in str(exc).replace(quoted, ""), str(exc)  # a Python caller is not told of options it cannot pass
    again = pickle.loads(pickle.dumps(exc))  # a Dask worker's error reaches the client whole
    assert type(again) is type(exc) and str(again) == str(exc) and vars(again) == vars(exc)
    return exc


def test_an_output_path_error_is_worded_with_out(tmp_path):
    out = tmp_path / "r.xlsx"
    exc = _raised(lambda: store.check_output_path(out))
    assert isinstance(exc, store.OutputPathError) and isinstance(exc, ValueError) and exc.out == out
    assert str(exc) == f"output {str(out)!r}: unknown suffix '.xlsx'; use one of .parquet, .csv, .json"
    assert said(exc) == f"--out {str(out)!r}: unknown suffix '.xlsx'; use one of .parquet, .csv, .json"
    folder = tmp_path / "d.csv"
    folder.mkdir()
    exc = _raised(lambda: store.check_output_path(folder, look_only=True))
    assert said(exc) == f"--out {str(folder)!r} is a folder; give a file name"


def test_an_existing_output_is_worded_with_force_and_resume(tmp_path):
    out = tmp_path / "r.csv"
    out.write_text("a\n1\n")
    exc = _raised(lambda: store.check_output(out, {}, resume=False, force=False))
    assert isinstance(exc, store.OutputExistsError) and (exc.out, exc.path, exc.unfinished) == (out, out, False)
    assert "force=True" in str(exc)
    assert said(exc) == f"{str(out)!r} exists; pass --force to replace it (or --resume to check it is complete)"
    parts = _with_a_finished_unit(store.parts_path(out))
    exc = _raised(lambda: store.check_output(out, {}, resume=False, force=False))
    assert (exc.path, exc.unfinished) == (parts, True) and "resume=True" in str(exc)
    assert said(exc) == (f"{str(parts)!r} holds an unfinished run; add --resume to continue it, or --force to start "
                         "afresh")


def test_a_finished_run_of_other_settings_is_worded_with_force_and_out(tmp_path):
    out = tmp_path / "r.csv"
    out.write_text("a\n1\n")
    out.with_name(out.name + ".meta.json").write_text(json.dumps({"config_identity": {"seed": 1}}))
    exc = _raised(lambda: store.check_output(out, {"seed": 2}, resume=True, force=False))
    assert isinstance(exc, store.FinishedRunMismatchError) and isinstance(exc, store.ResumeMismatchError)
    assert exc.out == out
    assert said(exc) == f"{str(out)!r} holds a finished run with different settings; use --force or another --out"


def test_a_damaged_manifest_is_worded_with_force(tmp_path):
    parts = _with_a_finished_unit(tmp_path / "r.csv.parts")
    (parts / "manifest.json").write_text('"text"')
    exc = _raised(lambda: store.check_manifest(parts))
    assert isinstance(exc, store.ManifestError) and isinstance(exc, ValueError)
    assert (exc.parts, exc.manifest) == (parts, parts / "manifest.json")
    assert exc.problem == "holds a JSON str, not an object with 'config' and 'activations'"
    assert said(exc) == f"{exc}; --force starts afresh (its finished units are lost)"


def test_changed_settings_are_said_alike_by_both(tmp_path):
    parts = _with_a_finished_unit(tmp_path / "x.parts")
    exc = _raised(lambda: store.prepare_parts_dir(parts, {"config": {"seed": 2}, "activations": {}}, resume=True))
    assert isinstance(exc, store.SettingsChangedError) and (exc.settings, exc.activations) == (("seed",), ())
    assert said(exc) == str(exc)  # no option to name: the same options and activations, or a new output


def test_parts_of_another_run_are_worded_with_resume(tmp_path):
    parts = _with_a_finished_unit(tmp_path / "x.parts")
    exc = _raised(lambda: store.prepare_parts_dir(parts, {"config": {}, "activations": {}}, resume=False))
    assert isinstance(exc, store.PartsExistError) and isinstance(exc, FileExistsError) and exc.parts == parts
    assert "pass resume=True" in str(exc)
    assert said(exc) == f"{str(parts)!r} already holds a sweep; pass --resume to continue it or remove the folder"


def test_a_locked_output_is_worded_with_out(tmp_path):
    target = tmp_path / "x.parquet"
    with store.sweep_lock(target):
        def second_writer():
            with store.sweep_lock(target):
                pass

        exc = _raised(second_writer)
    assert isinstance(exc, store.SweepLockedError) and exc.target == target and exc.holder.startswith("pid ")
    assert str(exc).endswith("; wait for it to finish, or write to another output")
    assert said(exc) == f"{exc.what}; wait for it to finish, or write to another --out"


@pytest.mark.parametrize(("text", "rest"), [
    ("processes:0", " 'processes:0': needs at least 1 worker process"),
    ("threads:2", " 'threads:2' is not understood; use local, processes:N or tcp://HOST:PORT"),
], ids=["no-worker", "not-understood"])
def test_a_scheduler_error_is_worded_with_scheduler(text, rest):
    from randattn.analysis.executors import SchedulerError, parse_scheduler

    exc = _raised(lambda: parse_scheduler(text))
    assert isinstance(exc, SchedulerError) and isinstance(exc, ValueError) and exc.scheduler == text
    assert str(exc) == "scheduler" + rest
    assert said(exc) == "--scheduler" + rest


def test_a_parameter_error_is_worded_with_the_running_commands_option():
    """The option comes from the command's click definition: ``check_reference`` is ``--check-reference`` in
    ``randattn mse``; outside a command the library's words stay."""
    import click

    from randattn._validation import ParameterError, check_device
    from randattn.analysis.plan import SweepConfig, parse_estimator_list
    from randattn.cli.mse import command

    device = _raised(lambda: check_device("tpu"))
    fraction = _raised(lambda: SweepConfig(estimators=parse_estimator_list(["ra"]), num_samples=(2,),
                                           check_reference=2.0))
    assert isinstance(device, ParameterError) and (device.parameter, device.shown) == ("device", "'tpu'")
    assert str(device).startswith("device='tpu' is not a torch device; available here: cpu")
    assert isinstance(fraction, ParameterError) and fraction.parameter == "check_reference"
    assert said(fraction) == str(fraction) == "check_reference must be a fraction in [0, 1], got 2.0"
    with click.Context(command):
        assert said(device) == "--device " + str(device)[len("device="):]
        assert said(fraction) == "--check-reference must be a fraction in [0, 1], got 2.0"


@pytest.mark.parametrize(("selection", "estimator", "cli"), [
    ("sample:3", "streaming", "use last:K, or --queries all"),
    ("last:3", "local", "measure it with --queries all, or under --mask causal with last:K"),
], ids=["sampled", "positioned"])
def test_a_query_placement_error_is_worded_with_queries_and_mask(selection, estimator, cli):
    from randattn.analysis.plan import parse_estimator_list
    from randattn.analysis.queries import QueryPlacementError, check_query_selection

    exc = _raised(lambda: check_query_selection(selection, 8, {0: None}, parse_estimator_list([estimator])))
    assert isinstance(exc, QueryPlacementError) and isinstance(exc, ValueError)
    assert (exc.label, exc.rows, exc.num_queries, exc.sampled) == (estimator, 3, 8, selection.startswith("sample"))
    assert exc.layer == (None if exc.sampled else 0)
    assert said(exc) == f"{exc.what}; {cli}"


@pytest.mark.parametrize(("stored", "cli"), [
    (0, "raise --max-memory or measure fewer queries (--queries last:K) (fewer --samples helps only where the "
        "estimator's memory grows with S)"),
    (10**9, "use fewer --replicates, select fewer --heads, or raise --max-memory"),
], ids=["one-replicate", "store"])
def test_a_unit_over_the_budget_is_worded_with_max_memory(stored, cli):
    exc = _raised(lambda: check_fits(100, 50, 1000 if stored else 100, label="ra", num_samples=8, tokens=5,
                                     stored=stored, replicates=7, heads=2))
    assert isinstance(exc, MemoryBudgetError) and isinstance(exc, ValueError)
    assert exc.store is bool(stored) and exc.label == "ra" and exc.num_samples == 8 and exc.tokens == 5
    assert exc.needed == (150 if not stored else 3 * stored) and exc.budget == (100 if not stored else 1000)
    assert said(exc) == f"{exc.what}; {cli}"
    assert exc.what.startswith("one replicate of one head of ra at S = 8 with 5 tokens needs about 150 B"
                               if not stored else "ra at S = 8 keeps the estimates of all 7 replicates of 2 head(s)")


@pytest.mark.parametrize(("raised", "code"), [
    (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes.\nError code 12"), 2),
    (RuntimeError("some other failure"), 1),
], ids=["torch-cpu-allocator", "not-memory"])
def test_a_failed_torch_allocation_is_said_as_out_of_memory_and_nothing_else_is(tmp_path, monkeypatch, raised,
                                                                                code):
    """torch's CPU allocator has no error type of its own: the library knows its words
    (:func:`~randattn.analysis.memory.allocation_failure`), the command line words the advice; any other
    RuntimeError stays unexpected (exit 1)."""
    from click.testing import CliRunner

    import randattn.analysis.sweep
    from randattn.activations import make_activations, save_activations
    from randattn.cli import main

    def fails(*args, **kwargs):
        raise raised

    acts = tmp_path / "a.safetensors"
    rng = np.random.default_rng(0)
    arrays = {0: tuple(rng.normal(size=(1, 1, 8, 4)) for _ in range(3))}
    save_activations(make_activations(arrays, {"scale": 0.5, "layout": "sequence"}), acts)
    monkeypatch.setattr(randattn.analysis.sweep, "run_sweep", fails)
    result = CliRunner().invoke(main, ["mse", str(acts), "-e", "ra", "--samples", "2", "--max-memory", "1GiB"])
    said_ = " ".join(result.stderr.split())
    assert result.exit_code == code, result.output
    if code == 2:
        assert said_.endswith("error: out of memory (DefaultCPUAllocator: can't allocate memory: you tried to "
                              "allocate 8 bytes.); lower --max-memory (now 1 GiB) so that work is split into smaller "
                              "blocks, or use fewer --samples / --replicates; nothing was kept (no --out)"), said_


def test_the_library_wordings_of_a_stopped_run_are_deprecated_for_the_command_lines(tmp_path):
    """``store.kept_message`` and ``records.resume_command`` spoke in the command line's options: they warn, name
    the CLI's own, and still say what it says."""
    from randattn.analysis.records import resume_command as old_resume
    from randattn.cli._errors import kept_message, resume_command

    argv = ["mse", "a.safetensors", "--force", "--out", "r.csv"]
    with pytest.warns(DeprecationWarning, match="randattn.cli._errors.resume_command") as caught:
        assert old_resume(argv) == resume_command(argv) == "randattn mse a.safetensors --out r.csv --resume"
    assert caught[0].filename == __file__
    parts = _with_a_finished_unit(tmp_path / "r.csv.parts")
    with pytest.warns(DeprecationWarning, match="randattn.cli._errors.kept_message") as caught:
        assert store.kept_message(parts, "again") == kept_message(parts, "again")
    assert caught[0].filename == __file__
    assert kept_message(parts, "again", then="later") == (f"; finished units are kept in {parts} for --resume; later, "
                                                          "continue with: again")


def test_a_configuration_without_s_over_the_budget_is_not_told_to_use_fewer_samples():
    """Adaptive vAttention takes no S: a configuration without S (None) is told of the budget and the queries only,
    in the command line's words and in Python's (one with S is told that fewer samples help only where memory
    grows with S: top-k's K x M scores do not)."""
    exc = _raised(lambda: check_fits(100, 50, 100, label="vattention", num_samples=None, tokens=5))
    assert said(exc) == f"{exc.what}; raise --max-memory or measure fewer queries (--queries last:K)"
    assert str(exc) == f"{exc.what}; raise max_memory or measure fewer queries (queries='last:K')"
