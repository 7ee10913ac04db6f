"""Helpers shared by the real-process CLI tests (imported from the tests' own folder)."""

from __future__ import annotations

import subprocess

import pytest


def finish(process: subprocess.Popen, timeout: float = 180) -> subprocess.CompletedProcess:
    """Wait for a started command (stdout and stderr piped, text); fail the test, killing it, after ``timeout`` s."""
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        pytest.fail(f"{process.args[3:]} still running after {timeout} s; stderr: {err[-2000:]}")
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)
