"""The tests here model an accelerator's run on the host: MagicPIG's sampler takes the form an accelerator runs.

On the CPU it reads hash buckets, whose sizes come from the data (host reads, operator calls that vary with the
data); on any other device it compares every (query, key, table, bit) and reads nothing back
(:data:`randattn.estimators.magicpig.batched.BUCKETED_DEVICES`). Counting launches and transfers on the host is
about the accelerator's form, so these tests take that form.
"""

from __future__ import annotations

import pytest

from randattn.estimators.magicpig import batched as magicpig_batched


@pytest.fixture(autouse=True)
def magicpig_samples_as_on_an_accelerator():
    # a patch of its own: tests here undo their ``monkeypatch`` midway
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(magicpig_batched, "BUCKETED_DEVICES", ())
        yield
