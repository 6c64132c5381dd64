"""A rank process's own bookkeeping: the early logs of standbys whose flow
process was killed are swept by the next pool (nobody else's files are
touched), and its stop flags each come from their own source."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from flows.training.launch.standby import EARLY_LOG_PREFIX, sweep_early_logs


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


def test_a_ranks_stop_flags_each_come_from_their_own_source(tmp_path: Path) -> None:
    from flows.training.rank.stop_flags import STOP_FILE, StopFlags

    flags = StopFlags.of_this_process()
    assert not (flags.terminated or flags.stop_asked(0) or flags.orphaned)
    flags.ask_stop(3)  # the scheduler's stop for its command 3, as a Ray actor is told it
    assert flags.stop_asked(2) and not flags.terminated
    assert not flags.stop_asked(3)  # a stop for a command its new round already applies no longer stands
    heard = StopFlags.of_this_process()
    heard.listen(tmp_path)  # a process rank: the coordinator forwards it as a file of its segment
    assert not heard.stop_asked(0)
    (tmp_path / STOP_FILE).write_text("5")
    assert heard.stop_asked(4) and not heard.stop_asked(5)
    flags.on_sigterm(15, None)
    assert flags.terminated and not flags.stop_asked(3)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert StopFlags(gone.pid).orphaned  # launched by a process that is not its parent now
    assert not StopFlags(None).orphaned  # a Ray actor: its raylet is its parent, Ray ends it with its owner
