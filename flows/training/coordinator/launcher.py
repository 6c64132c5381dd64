"""Launch one training segment as `world_size` worker processes and supervise it.

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

A segment launched `in_place` lives on across resizes (`regroup`): its ranks
pause at a stop, and the launcher tells them the next round's ranks: those on
GPUs that stay keep their process and state, the others leave, newcomers come
from the standby pool (regroup.py has the protocol).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from flows.training.control import GpuSlot
from flows.training.launch.identity import RankIdentity
from flows.training.orders import RankOrder, Seat, StandbyOrder, free_port, rank_orders
from flows.training.regroup import Next, next_file, result_file, spec_file, write_private
from flows.training.segment import SegmentResult, SegmentSpec
from flows.training.launch.standby import POOL, Worker, WorkerPool
from flows.training.supervision import (
    HANDOVER_S,
    ProgressCallback,
    RankFailure,
    crash_result,
    crashed,
    exit_failure,
    read_progress,
)

__all__ = ["POOL", "Segment", "WorkerPool", "local_seats", "prune_segment_dirs", "run_segment"]

log = logging.getLogger("elasticflow.launcher")

# The address the ranks of a job listen on, and its interface: this launcher
# starts every rank on this machine, so loopback. Ranks spread over nodes bind
# the address of their node's interface for the job instead; never all.
JOB_ADDR, JOB_IFNAME = "127.0.0.1", "lo"


def local_seats(gpus: list[int]) -> list[Seat]:
    """Every rank on this machine, on loopback, GPU id = device index."""
    return [Seat(node="localhost", interface=JOB_IFNAME, device_index=gpu) for gpu in gpus]


class Segment:
    """A running segment: its processes, its folder, and how to stop it."""

    def __init__(
        self, spec: SegmentSpec, gpus: list[int], workdir: Path | None = None, pool: WorkerPool | None = None,
        identity: RankIdentity | None = None,
    ) -> None:
        if not gpus:
            raise ValueError("a segment needs at least one GPU / worker slot")
        self.spec, self.gpus, self.identity = spec, list(gpus), identity
        if workdir is not None:
            workdir.mkdir(parents=True, exist_ok=True, mode=0o700)
            if identity is not None:
                identity.share(workdir, contents=False)
        self.dir = Path(tempfile.mkdtemp(prefix=f"segment-{spec.run_key[:12]}-", dir=workdir))  # 0700
        with open(self.dir / "spec.json", "w", opener=lambda name, flags: os.open(name, flags, 0o600)) as fh:
            fh.write(spec.model_dump_json())
        if identity is not None:  # its ranks write logs, progress and the result here, and read the spec
            identity.share(self.dir)
        self.procs: list[Worker] = []
        self.orders: list[RankOrder] = []
        self.logs: list[Path] = []  # by rank in the current round
        self.pool = pool or POOL
        self.launch_t = 0.0
        self.round = 0  # resizes in place so far
        self.paused: SegmentResult | None = None  # its ranks wait in memory for the next round
        self._released: SegmentResult | None = None  # what they said when they saved and left
        self._progress_offset = 0

    def start(self) -> None:
        port = free_port(JOB_ADDR)
        self.launch_t = time.time()
        self.orders = rank_orders(local_seats(self.gpus), JOB_ADDR, port, self.spec.device, self.launch_t, self.gpus)
        self.procs = self.pool.take(len(self.gpus))
        self.logs = [self.dir / f"rank{order.rank}.log" for order in self.orders]
        self._hand_over(self.procs, self.orders, joins=False)
        log.debug("segment started run_key=%s gpus=%s port=%d dir=%s", self.spec.run_key, self.gpus, port, self.dir)

    def _hand_over(self, procs: list[Worker], orders: list[RankOrder], joins: bool) -> None:
        for order, proc in zip(orders, procs):
            line = StandbyOrder(segment_dir=str(self.dir), log=str(self._log(order.rank)), order=order,
                                identity=self.identity, spec_file=spec_file(self.round), round=self.round,
                                joins=joins)
            assert proc.stdin is not None
            try:
                proc.stdin.write(line.model_dump_json().encode() + b"\n")
                proc.stdin.close()
            except BrokenPipeError:  # it died while waiting; supervision reports the crash
                log.warning("worker rank=%d exited before its segment was handed over", order.rank)

    def _log(self, rank: int) -> Path:
        return self.logs[rank] if rank < len(self.logs) else self.dir / f"rank{rank}.log"

    def _write(self, name: str, text: str) -> None:
        write_private(self.dir / name, text, self.identity.share_file if self.identity else None)

    def regroup(self, spec: SegmentSpec, gpus: list[int], placement: list[GpuSlot] | None = None) -> bool:
        """Go on in place on `gpus` (regroup.py): the ranks on GPUs that stay
        keep their state, the others leave, newcomers join and get it from
        them. Returns once the leavers are gone (their GPUs are free then);
        False, touching nothing, when it cannot: not paused, none of its GPUs
        in `gpus`, or a rank already gone (then `release` it). Every rank is
        on this machine: `placement` (a cluster's) says nothing more."""
        if self.paused is None or not set(gpus) & set(self.gpus) or any(p.poll() is not None for p in self.procs):
            return False
        stay = [r for r, gpu in enumerate(self.gpus) if gpu in gpus]  # the new rank 0 is one that stays
        new_gpus = [self.gpus[r] for r in stay] + [gpu for gpu in gpus if gpu not in self.gpus]
        port, self.launch_t = free_port(JOB_ADDR), time.time()
        orders = rank_orders(local_seats(new_gpus), JOB_ADDR, port, spec.device, self.launch_t, new_gpus)
        ended, self.round = self.round, self.round + 1
        self._write(spec_file(self.round), spec.model_dump_json())
        word = Next(round=self.round, action="regroup", spec_file=spec_file(self.round),
                    orders={r: orders[stay.index(r)] if r in stay else None for r in range(len(self.gpus))})
        joiners = self.pool.take(len(new_gpus) - len(stay))
        leavers = [proc for r, proc in enumerate(self.procs) if r not in stay]
        self.logs = [self.logs[r] for r in stay] + [self.dir / f"rank{o.rank}-round{self.round}.log"
                                                     for o in orders[len(stay):]]
        self._write(next_file(ended), word.model_dump_json())
        self._hand_over(joiners, orders[len(stay):], joins=True)
        self.procs = [self.procs[r] for r in stay] + joiners
        self.spec, self.gpus, self.orders, self.paused = spec, new_gpus, orders, None
        self._await_exit(leavers)
        log.debug("segment resized in place run_key=%s round=%d gpus=%s (%d stay, %d join, %d leave)",
                  spec.run_key, self.round, new_gpus, len(stay), len(joiners), len(leavers))
        return True

    def release(self) -> SegmentResult | None:
        """A paused segment that does not go on in place: its ranks save where
        they stand and exit; their last result (None if they could not say).
        Asked again, the same result: the ranks may be let go inside the
        segment's task and the record read by the loop after it."""
        if self.paused is None:
            return self._released
        self.paused = None
        self._write(next_file(self.round), Next(round=self.round, action="save").model_dump_json())
        self._await_exit(self.procs, timeout_s=120.0)
        if any(p.poll() != 0 for p in self.procs):
            return None
        result = SegmentResult.model_validate_json((self.dir / result_file(self.round)).read_text())
        result.gpus = self.gpus
        self._released = result
        return result

    def _await_exit(self, procs: list[Worker], timeout_s: float = 30.0) -> None:
        """Until `procs` are gone; those still there after `timeout_s` (stuck
        with a peer that died) are killed: the GPUs are someone else's now."""
        end = time.time() + timeout_s
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, end - time.time()))
            except subprocess.TimeoutExpired:
                log.warning("rank pid=%d did not leave in %.0f s: killed", proc.pid, timeout_s)
                proc.kill()
                proc.wait()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def request_stop(self) -> None:
        """Ask every worker to stop at the next iteration boundary (SIGTERM)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    def kill(self, grace_s: float = 5.0) -> None:
        self.request_stop()
        deadline = time.time() + grace_s
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _forward_progress(self, on_progress: ProgressCallback | None) -> None:
        lines, self._progress_offset = read_progress(self.dir, self._progress_offset)
        for line in lines:
            if on_progress:
                on_progress(line)

    def _log_tail(self, rank: int, chars: int = 2000) -> str:
        path = self._log(rank)
        if path.exists():
            return path.read_text(errors="replace")[-chars:]
        early = getattr(self.procs[rank], "standby_log", None) if rank < len(self.procs) else None
        if early and Path(early).exists():  # it never got as far as its segment: what it said before
            return "(before taking its segment) " + Path(early).read_text(errors="replace")[-chars:]
        return ""

    def _failures(self, codes: list[int | None]) -> list[RankFailure]:
        """Ranks that failed: exited with an error, or never took their segment
        (no log of theirs): gone without it, or still without it HANDOVER_S
        after the launch. A standby that never starts its segment would
        otherwise hold the others in their rendezvous until its timeout."""
        late = time.time() > self.launch_t + HANDOVER_S
        failed = []
        for rank, code in enumerate(codes):
            took = self._log(rank).exists()
            if (code not in (None, 0) and took) or ((code is not None or late) and not took):
                failed.append(exit_failure(rank, code, took))
        return failed

    def wait(
        self, on_progress: ProgressCallback | None = None, timeout_s: float | None = None, poll_s: float = 0.05
    ) -> SegmentResult:
        try:
            return self._wait(on_progress, poll_s, timeout_s)
        finally:
            for proc in self.procs:  # read into any crash report by now; a standby handed over removed its own
                early = getattr(proc, "standby_log", None)
                if early:
                    Path(early).unlink(missing_ok=True)

    def _wait(
        self, on_progress: ProgressCallback | None, poll_s: float, timeout_s: float | None
    ) -> SegmentResult:
        """Block until every worker exits; crash handling kills the survivors.

        `timeout_s`: for segments that must end on their own (a profile), a hang
        (a rendezvous that never completes, a stuck collective) is reported as a
        crash with the ranks' logs instead of blocking the caller for ever."""
        give_up = None if timeout_s is None else time.time() + timeout_s
        while True:
            codes = [p.poll() for p in self.procs]
            if give_up is not None and time.time() > give_up and any(c is None for c in codes):
                self.kill(grace_s=2.0)
                logs = " | ".join(f"rank {r}: {self._log_tail(r, 600)}" for r in range(len(self.procs)))
                log.warning("segment timed out run_key=%s after=%.0fs dir=%s", self.spec.run_key, timeout_s, self.dir)
                return crashed(self.gpus, self.launch_t,
                               f"did not finish in {timeout_s:.0f} s (exit codes {codes}): {logs}")
            self._forward_progress(on_progress)
            failed = self._failures(codes)
            if failed:
                # Survivors are stuck in a collective with a dead peer: no point
                # in a graceful stop, the last checkpoint is what we resume from.
                self.kill(grace_s=0.0)
                result, cause = crash_result(self.gpus, self.launch_t, failed, lambda f: self._log_tail(f.rank))
                log.warning("segment crashed run_key=%s rank=%d how=%s (%s) dir=%s", self.spec.run_key, cause.rank,
                            cause.how.value, cause.detail, self.dir)
                return result
            if all(c == 0 for c in codes):
                break
            paused = self._paused_result()
            if paused is not None:  # the ranks wait for `regroup` or `release`
                self._forward_progress(on_progress)
                self.paused = paused
                return paused
            time.sleep(poll_s)
        self._forward_progress(on_progress)
        result = SegmentResult.model_validate_json((self.dir / result_file(self.round)).read_text())
        result.gpus = self.gpus
        return result

    def _paused_result(self) -> SegmentResult | None:
        path = self.dir / result_file(self.round)
        if not self.spec.in_place or not path.exists():
            return None
        result = SegmentResult.model_validate_json(path.read_text())
        result.gpus = self.gpus
        return result if result.paused else None


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
    segment = Segment(spec, gpus, workdir, identity=identity)
    segment.start()
    try:
        return segment.wait(on_progress, timeout_s=timeout_s)
    except BaseException:
        segment.kill(grace_s=2.0)
        raise
