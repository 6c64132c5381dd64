"""Early logs of standbys whose flow process was killed are swept by the next
pool; nobody else's files are touched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from flows.training.standby import EARLY_LOG_PREFIX, sweep_early_logs


def test_the_early_logs_of_a_gone_flow_process_are_swept_and_no_others(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid names no process now
    left = tmp_path / f"{EARLY_LOG_PREFIX}{gone.pid}-abc123.log"
    mine = tmp_path / f"{EARLY_LOG_PREFIX}{os.getpid()}-def456.log"
    alive = tmp_path / f"{EARLY_LOG_PREFIX}1-ghi789.log"  # init's: never gone
    unnamed = tmp_path / f"{EARLY_LOG_PREFIX}q1w2e3r4.log"  # not of this scheme
    for path in (left, mine, alive, unnamed):
        path.write_text("")
    assert sweep_early_logs(str(tmp_path)) == 1
    assert not left.exists() and mine.exists() and alive.exists() and unnamed.exists()
