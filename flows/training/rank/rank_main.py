"""A process rank's entry: `python -m flows.training.rank.rank_main --standby
[EARLY_LOG]` (see `flows.training.launch.standby`). It imports torch, then reads its
order on stdin (`orders.StandbyOrder`: the segment's folder, its log, its
rank's `RankOrder`), and runs the segment's `Worker` (rank.py) with the stop
flags it made at its start, when its parent was still its launcher.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from pathlib import Path
from typing import NoReturn

import torch.distributed as dist

from flows.training.orders import StandbyOrder
from flows.training.rank.rank import Worker
from flows.training.segment import SegmentSpec
from flows.training.rank.stop_flags import StopFlags


def main(order: StandbyOrder, flags: StopFlags) -> NoReturn:
    signal.signal(signal.SIGTERM, flags.on_sigterm)
    os.umask(0o077)  # checkpoints, logs, progress: private, whoever started this rank
    rank = order.order.rank
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank={rank} %(name)s %(levelname)s %(message)s",
                        force=True)  # a worker forked from a flow process inherits its handlers
    folder = Path(order.segment_dir)
    flags.listen(folder)  # the scheduler's stop, as its coordinator forwards it
    spec = SegmentSpec.model_validate_json((folder / order.spec_file).read_text())
    worker = Worker(spec, folder, order.order, flags, order.round)
    worker.start(order.joins)
    if not worker.rounds():
        _exit(0)  # it left at a resize in place: its group is gone already
    dist.barrier()
    dist.destroy_process_group()
    # Exit from here: returning would free `worker` (its DDP model and reducer),
    # whose process-group destructors can wait for ever on a peer that has
    # already exited (seen about once in ten 2-worker segments with gloo).
    _exit(0)


def standby(flags: StopFlags, early_log: str | None = None) -> int:
    """Wait, with torch already imported, for the launcher to hand over a segment.

    The launcher writes one JSON line on stdin, a `StandbyOrder`: the segment
    folder, the log file, and the rank's order, whose environment (rank,
    rendezvous, CUDA_VISIBLE_DEVICES) is applied before anything touches
    CUDA. EOF means the launcher is gone: exit quietly. `early_log` holds
    what this process said before it had a segment (for a crash report); it
    is removed once the segment's own log takes over.
    """
    import torch._dynamo  # noqa: F401  # the first optimizer step imports it: ~2 s

    line = sys.stdin.readline()
    if not line.strip():
        if early_log:
            with contextlib.suppress(OSError):
                os.unlink(early_log)
        return 0
    order = StandbyOrder.model_validate_json(line)
    os.environ.update(order.order.env())
    if early_log:  # while it is still the launcher's to remove
        with contextlib.suppress(OSError):
            os.unlink(early_log)
    if order.identity is not None:  # before the segment's files, the user's model or data are touched
        order.identity.assume(Path(order.segment_dir))
    fd = os.open(order.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return main(order, flags)


def run_standby(early_log: str | None = None, launcher_pid: int | None = None) -> None:
    """Be a standby until handed a segment, run it, exit. Its launcher (the
    flow process that started or forked it) is its parent now, or is
    `launcher_pid` (the fork server forked it for that process)."""
    flags = StopFlags.of_this_process() if launcher_pid is None else StopFlags.watching(launcher_pid)
    _exit(standby(flags, early_log))


def _exit(code: int) -> NoReturn:
    # Everything is on disk (checkpoint, result.json); skip interpreter teardown,
    # which takes ~1 s with torch loaded and sits on the rescale path.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    if sys.argv[1:2] != ["--standby"]:
        sys.exit("usage: python -m flows.training.rank.rank_main --standby [EARLY_LOG] (started by flows.training.launch.standby)")
    run_standby(early_log=sys.argv[2] if len(sys.argv) > 2 else None)
