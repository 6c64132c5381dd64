"""Ranks as processes on this machine: the process transport of a segment
(`segment_machine.Segment`, which supervises it).

Each worker is a `python -m flows.training.rank.rank_main --standby` process, never a
fork of the flow process (which runs Prefect's threads). A standby imports
torch, then waits on stdin for a segment. `WorkerPool` (`flows.training.launch.standby`)
keeps a few standbys ready so that a relaunch does not pay ~4 s of imports per
worker (torch, and
`torch._dynamo` which the first optimizer step pulls in): on a small machine
that is most of a rescale. Missing standbys are started on demand.

Ranks see only the environment they need (`standby.rank_env`, an allow-list:
no Prefect settings, no database URL, no password of the worker's) and listen
on the job's address only (loopback here), never on every interface.

A "GPU" is a CUDA device id passed through CUDA_VISIBLE_DEVICES; on a CPU-only
machine it is a worker slot. If any worker dies, the others are killed and the
segment reports `crashed`: the flow then relaunches from the last checkpoint.

A segment's folder holds what its ranks and the coordinator say to each
other: the spec of each round, rank 0's progress and result, the word for
paused ranks (regroup.py), and the scheduler's stop as the coordinator
forwards it (`stop_flags.STOP_FILE`).
"""

from __future__ import annotations

import logging
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from flows.training.control import GpuSlot
from flows.training.coordinator.segment_machine import Segment
from flows.training.launch.identity import RankIdentity
from flows.training.launch.standby import POOL, Worker, WorkerPool
from flows.training.orders import RankOrder, Seat, StandbyOrder, free_port, rank_orders
from flows.training.rank.stop_flags import STOP_FILE
from flows.training.regroup import result_file, spec_file, write_private
from flows.training.segment import SegmentResult, SegmentSpec
from flows.training.supervision import HANDOVER_S, ProgressCallback, ProgressLine, RankFailure, exit_failure, read_progress

__all__ = ["POOL", "Processes", "WorkerPool", "local_seats", "local_segment", "prune_segment_dirs", "run_segment"]

log = logging.getLogger("elasticflow.launcher")

# The address the ranks of a job listen on, and its interface: this launcher
# starts every rank on this machine, so loopback. Ranks spread over nodes bind
# the address of their node's interface for the job instead; never all.
JOB_ADDR, JOB_IFNAME = "127.0.0.1", "lo"


def local_seats(gpus: list[int]) -> list[Seat]:
    """Every rank on this machine, on loopback, GPU id = device index."""
    return [Seat(node="localhost", interface=JOB_IFNAME, device_index=gpu) for gpu in gpus]


@dataclass
class ProcessRank:
    """A rank process: a standby until handed its part, then the log it writes to."""

    proc: Worker
    log: Path | None = None


class Processes:
    """The process transport: every rank a process on this machine, taken
    from the warm standby `pool`, meeting on loopback, told through the
    segment's folder (0700, shared with the ranks' account through
    `identity`)."""

    poll_s = 0.05

    def __init__(self, spec: SegmentSpec, workdir: Path | None = None, pool: WorkerPool | None = None,
                 identity: RankIdentity | None = None) -> None:
        self.pool, self.identity = pool or POOL, identity
        if workdir is not None:
            workdir.mkdir(parents=True, exist_ok=True, mode=0o700)
            if identity is not None:
                identity.share(workdir, contents=False)
        self.dir = Path(tempfile.mkdtemp(prefix=f"segment-{spec.run_key[:12]}-", dir=workdir))  # 0700
        if identity is not None:  # its ranks write logs, progress and the result here, and read the spec
            identity.share(self.dir)
        self._offset = 0  # in rank 0's progress file, which every round's rank 0 appends to

    def slots(self, gpus: list[int], placement: list[GpuSlot] | None) -> list[int]:
        """A GPU is its own slot: every rank is on this machine, and a
        cluster's `placement` says nothing more."""
        return list(gpus)

    def take(self, slots: list[int]) -> list[ProcessRank]:
        return [ProcessRank(proc) for proc in self.pool.take(len(slots))]

    def meet(self, ranks: list[ProcessRank], gpus: list[int], spec: SegmentSpec, launch_t: float) -> list[RankOrder]:
        return rank_orders(local_seats(gpus), JOB_ADDR, free_port(JOB_ADDR), spec.device, launch_t, gpus)

    def hand_over(self, ranks: list[ProcessRank], orders: list[RankOrder], spec: SegmentSpec,
                  round_: int, joins: bool) -> None:
        if round_ == 0:
            self._write(spec_file(0), spec.model_dump_json())
        for order, rank in zip(orders, ranks):
            rank.log = self.dir / (f"rank{order.rank}.log" if round_ == 0 else f"rank{order.rank}-round{round_}.log")
            line = StandbyOrder(segment_dir=str(self.dir), log=str(rank.log), order=order, identity=self.identity,
                                spec_file=spec_file(round_), round=round_, joins=joins)
            stdin = rank.proc.stdin
            assert stdin is not None
            try:
                stdin.write(line.model_dump_json().encode() + b"\n")
                stdin.close()
            except BrokenPipeError:  # it died while waiting; supervision reports the crash
                log.warning("worker rank=%d exited before its segment was handed over", order.rank)

    def tell(self, ranks: list[ProcessRank], files: dict[str, str]) -> None:
        for name, text in files.items():
            self._write(name, text)

    def _write(self, name: str, text: str) -> None:
        write_private(self.dir / name, text, self.identity.share_file if self.identity else None)

    def progress(self, rank0: ProcessRank, round_: int) -> tuple[list[ProgressLine], str]:
        lines, self._offset = read_progress(self.dir, self._offset)
        path = self.dir / result_file(round_)
        return lines, path.read_text() if path.exists() else ""

    def watch(self, ranks: list[ProcessRank], launch_t: float) -> tuple[bool, list[RankFailure]]:
        """Ranks that failed: exited with an error, or never took their segment
        (no log of theirs): gone without it, or still without it HANDOVER_S
        after the launch. A standby that never starts its segment would
        otherwise hold the others in their rendezvous until its timeout."""
        codes = [rank.proc.poll() for rank in ranks]
        late = time.time() > launch_t + HANDOVER_S
        failed = []
        for r, (rank, code) in enumerate(zip(ranks, codes)):
            took = rank.log is not None and rank.log.exists()
            if (code not in (None, 0) and took) or ((code is not None or late) and not took):
                failed.append(exit_failure(r, code, took))
        return all(code == 0 for code in codes), failed

    def idle(self, ranks: list[ProcessRank], seconds: float) -> None:
        time.sleep(seconds)

    def result(self, ranks: list[ProcessRank], round_: int, wait_s: float) -> str | None:
        self.end(ranks, wait_s)
        path = self.dir / result_file(round_)
        if any(rank.proc.poll() != 0 for rank in ranks) or not path.exists():
            return None
        return path.read_text()

    def stop(self, ranks: list[ProcessRank], terminate: bool, seq: int = 0) -> None:
        """A SIGTERM to each; the scheduler's stop as a file rank 0 reads at each boundary."""
        if not terminate:
            self._write(STOP_FILE, str(seq))
            return
        for rank in ranks:
            if rank.proc.poll() is None:
                rank.proc.send_signal(signal.SIGTERM)

    def end(self, ranks: list[ProcessRank], wait_s: float) -> None:
        """Those still there after `wait_s` (stuck with a peer that died) are
        killed: the GPUs are someone else's now."""
        end = time.time() + wait_s
        for rank in ranks:
            try:
                rank.proc.wait(timeout=max(0.0, end - time.time()))
            except subprocess.TimeoutExpired:
                if wait_s > 0:
                    log.warning("rank pid=%d did not leave in %.0f s: killed", rank.proc.pid, wait_s)
                rank.proc.kill()
                rank.proc.wait()

    def gone(self, ranks: list[ProcessRank]) -> bool:
        return any(rank.proc.poll() is not None for rank in ranks)

    def log_tail(self, ranks: list[ProcessRank], failure: RankFailure, chars: int = 2000) -> str:
        rank = ranks[failure.rank] if failure.rank < len(ranks) else None
        if rank is None:
            return ""
        if rank.log is not None and rank.log.exists():
            return rank.log.read_text(errors="replace")[-chars:]
        early = getattr(rank.proc, "standby_log", None)
        if early and Path(early).exists():  # it never got as far as its segment: what it said before
            return "(before taking its segment) " + Path(early).read_text(errors="replace")[-chars:]
        return ""

    def after(self, ranks: list[ProcessRank], paused: bool) -> None:
        for rank in ranks:  # read into any crash report by now; a standby handed over removed its own
            early = getattr(rank.proc, "standby_log", None)
            if early:
                Path(early).unlink(missing_ok=True)

    def pids(self, ranks: list[ProcessRank]) -> list[int]:
        return [rank.proc.pid for rank in ranks]


def local_segment(spec: SegmentSpec, gpus: list[int], workdir: Path | None = None, pool: WorkerPool | None = None,
                  identity: RankIdentity | None = None) -> Segment:
    """A segment of rank processes on this machine, its folder under `workdir`."""
    return Segment(spec, gpus, Processes(spec, workdir, pool, identity))


def prune_segment_dirs(folder: Path, keep: int = 5) -> None:
    """Keep the newest `keep` segment folders (logs, progress, result) of a run."""
    if not folder.exists():
        return
    dirs = sorted((d for d in folder.iterdir() if d.is_dir()), key=lambda d: d.stat().st_mtime)
    for old in dirs[:-keep] if keep else dirs:
        shutil.rmtree(old, ignore_errors=True)


def run_segment(
    spec: SegmentSpec,
    gpus: list[int],
    on_progress: ProgressCallback | None = None,
    workdir: Path | None = None,
    timeout_s: float | None = None,
    identity: RankIdentity | None = None,
) -> SegmentResult:
    """Launch, supervise and collect one segment."""
    segment = local_segment(spec, gpus, workdir, identity=identity)
    segment.start()
    try:
        return segment.wait(on_progress, timeout_s=timeout_s)
    except BaseException:
        segment.kill(grace_s=2.0)
        raise
