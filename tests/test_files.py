"""Atomic writes: a finished file has ordinary permissions; an interrupted one leaves nothing."""

from __future__ import annotations

import os
import stat

import pytest

from randattn._files import atomic_path, atomic_write_text


def test_written_file_has_umask_permissions_not_private(tmp_path):
    target = tmp_path / "table.csv"
    atomic_write_text(target, "a,b\n1,2\n")
    assert target.read_text() == "a,b\n1,2\n"
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~mask


def test_interrupted_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "acts.safetensors"
    target.write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise KeyboardInterrupt
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["acts.safetensors"]
