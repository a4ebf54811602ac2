"""The test harness's own contract (tests/conftest.py): a rank that dies by a signal is named at once
with its signal and its Python stack, and the test is rerun once on a fresh pool with a warning; it is
never a timeout. (A second death raises ``RankDied``: not exercised here, each death costs a pool's
start-up.)"""
from __future__ import annotations

import os
import re
import signal
import time

import pytest
import torch.distributed as dist

from conftest import RankDiedWarning


def _abort_on_rank_1_once(marker_dir: str) -> int:
    """Rank 1 aborts the first time it runs this (as a native crash would); both ranks return their
    rank afterwards."""
    marker = os.path.join(marker_dir, "aborted_once")
    if dist.get_rank() == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGABRT)
    return dist.get_rank()


def test_a_rank_killed_by_a_signal_is_named_and_the_test_rerun_once_with_a_warning(dist, tmp_path):
    start = time.monotonic()
    with pytest.warns(RankDiedWarning, match=r"rank 1 \(killed by SIGABRT\) died running _abort_on_rank_1_once") as caught:
        assert dist.run(2, _abort_on_rank_1_once, str(tmp_path)) == [0, 1]
    # The dead rank's Python stack, as faulthandler wrote it, is quoted in the warning.
    message = str(caught[0].message)
    assert "--- rank 1, faulthandler ---" in message and "Fatal Python error: Aborted" in message, message
    assert re.search(r'File ".*test_harness.py", line \d+ in _abort_on_rank_1_once', message), message
    assert time.monotonic() - start < 60  # found by polling the ranks, not by the 300 s task timeout
