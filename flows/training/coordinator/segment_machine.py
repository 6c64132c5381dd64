"""One segment of a run's training, whatever carries its ranks.

A segment is one launch of a run's DDP ranks, from its latest state up to a
stop. `start` hands each rank its part; `wait` forwards rank 0's progress
and the scheduler's stop, and returns once the ranks are done, once one
failed (the others are ended: a crash, and the run goes on from its last
checkpoint), or, for a segment launched `in_place`, once they paused at a
stop; a paused segment then goes on in place on a new GPU set (`regroup`,
with `regroup.plan_regroup` saying who stays, joins and leaves) or its ranks
save where they stand and end (`release`).

That life is written once, here. What differs between ranks that are
processes on this machine (launcher.py) and ranks that are Ray actors on a
cluster's nodes (ray_ranks.py) is a `Transport`: how ranks are taken, where
their group meets, how they are told things, watched and ended.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Hashable, Protocol

from flows.training.control import FileControlChannel, GpuSlot
from flows.training.orders import RankOrder
from flows.training.regroup import Next, next_file, plan_regroup, spec_file
from flows.training.segment import SegmentResult, SegmentSpec
from flows.training.supervision import Failure, ProgressCallback, ProgressLine, RankFailure, crash_result, crashed

log = logging.getLogger("elasticflow.segment")

RELEASE_S = 120.0  # paused ranks told to save have this long to save and end
LEAVE_S = 30.0  # ranks leaving at a resize in place are ended after this long


class RanksGone(Exception):
    """Ranks that cannot be reached or started (a node going away, a rank
    misplaced); `died`: a rank's process or node is gone."""

    def __init__(self, message: str, died: bool = False) -> None:
        super().__init__(message)
        self.died = died


class Transport(Protocol):
    """How a segment reaches its ranks. A rank is a handle the transport
    made (`take`); the segment keeps them in rank order."""

    poll_s: float  # how often `wait` looks

    def slots(self, gpus: list[int], placement: list[GpuSlot] | None) -> list[Hashable]:
        """Where each GPU's rank runs (ValueError: GPUs the cluster does not have)."""

    def take(self, slots: list[Hashable]) -> list[Any]:
        """Warm ranks for `slots`, not told anything yet (RanksGone: they cannot be made)."""

    def meet(self, ranks: list[Any], gpus: list[int], spec: SegmentSpec, launch_t: float) -> list[RankOrder]:
        """Each rank's order, the group meeting at the first's address
        (RanksGone: a rank cannot be reached; ValueError: the spec cannot
        run where they are)."""

    def hand_over(self, ranks: list[Any], orders: list[RankOrder], spec: SegmentSpec, round_: int,
                  joins: bool) -> None:
        """Each rank starts its part of round `round_` (RanksGone: it cannot)."""

    def tell(self, ranks: list[Any], files: dict[str, str]) -> None:
        """Word for paused ranks, as files of their round, in the order given (RanksGone: a rank is gone)."""

    def progress(self, rank0: Any, round_: int) -> tuple[list[ProgressLine], str]:
        """Rank 0's new progress lines, and its result of `round_` once written ("" before)."""

    def watch(self, ranks: list[Any], launch_t: float) -> tuple[bool, list[RankFailure]]:
        """Whether every rank ended well, and the ranks that failed (at once)."""

    def idle(self, ranks: list[Any], seconds: float) -> None:
        """Wait `seconds`, or less if a rank ends."""

    def result(self, ranks: list[Any], round_: int, wait_s: float) -> str | None:
        """Rank 0's result of `round_` once every rank ended well (within
        `wait_s`; those still there then are ended); None if one did not."""

    def stop(self, ranks: list[Any], terminate: bool, seq: int = 0) -> None:
        """Every rank stops at its next iteration boundary: the scheduler's
        stop for command `seq`, or (`terminate`) as on SIGTERM."""

    def end(self, ranks: list[Any], wait_s: float) -> None:
        """Until the ranks' processes are gone: ended once `wait_s` has passed."""

    def gone(self, ranks: list[Any]) -> bool:
        """Whether a rank has ended already."""

    def log_tail(self, ranks: list[Any], failure: RankFailure) -> str:
        """What the failed rank said last."""

    def after(self, ranks: list[Any], paused: bool) -> None:
        """`wait` returned: what is left of ranks that no longer run (a paused round's live on)."""

    def pids(self, ranks: list[Any]) -> list[int]: ...


class Segment:
    """A running segment (a `supervision.RunningSegment`) over a `Transport`."""

    def __init__(self, spec: SegmentSpec, gpus: list[int], transport: Transport,
                 placement: list[GpuSlot] | None = None) -> None:
        if not gpus:
            raise ValueError("a segment needs at least one GPU / worker slot")
        self.spec, self.gpus, self.transport = spec, list(gpus), transport
        self.slots = transport.slots(self.gpus, placement)
        # The scheduler's commands for this run, which the segment forwards to its ranks as a stop.
        self.control = FileControlChannel(spec.run_key, spec.control_dir) if spec.control_dir else None
        self.ranks: list[Any] = []
        self.orders: list[RankOrder] = []
        self.launch_t = 0.0
        self.round = 0  # resizes in place so far
        self.paused: SegmentResult | None = None  # its ranks wait in memory for the next round
        self._released: SegmentResult | None = None  # what they said when they saved and left
        self.start_error: str | None = None  # its ranks could not start: `wait` reports a crash
        self.died = False  # a rank's process died under it (killed, or its node lost)
        self._iteration = 0  # the last one rank 0 reported
        self._stop_sent = False  # the scheduler's stop, forwarded to this round

    @property
    def pids(self) -> list[int]:
        return self.transport.pids(self.ranks)

    def start(self) -> None:
        """Hand each rank its part. Ranks that cannot start make the segment
        a crash, as a rank failing later would."""
        self.launch_t = time.time()
        try:
            self.ranks = self.transport.take(self.slots)
            self.orders = self.transport.meet(self.ranks, self.gpus, self.spec, self.launch_t)
            self.transport.hand_over(self.ranks, self.orders, self.spec, self.round, joins=False)
        except RanksGone as exc:
            self.died = self.died or exc.died
            self.start_error = str(exc)
        log.debug("segment started run_key=%s gpus=%s", self.spec.run_key, self.gpus)

    def regroup(self, spec: SegmentSpec, gpus: list[int], placement: list[GpuSlot] | None = None) -> bool:
        """Go on in place on `gpus` (on a cluster, the slots `placement`
        names): the ranks whose GPU stays keep their state, the others leave
        and are ended, newcomers join and get it from them. Returns once the
        leavers are gone (their GPUs are free then); False, telling the ranks
        nothing, when it cannot: not paused, no GPU stays, a rank gone, or a
        newcomer that cannot start (then `release` it). A rank lost once
        they were told makes the segment a crash, which its `wait` reports."""
        if self.paused is None:
            return False
        try:
            slots = self.transport.slots(gpus, placement)
        except ValueError:  # GPUs the cluster does not have: the segment that tries them will say so
            return False
        plan = plan_regroup(list(zip(self.gpus, self.slots)), list(zip(gpus, slots)))
        if not plan.stay or self.transport.gone(self.ranks):
            return False
        joiners: list[Any] = []
        new_gpus = [self.gpus[r] for r in plan.stay] + [gpus[i] for i in plan.joining]
        new_slots = [self.slots[r] for r in plan.stay] + [slots[i] for i in plan.joining]
        launch_t = time.time()
        try:
            joiners = self.transport.take([slots[i] for i in plan.joining])
            ranks = [self.ranks[r] for r in plan.stay] + joiners
            orders = self.transport.meet(ranks, new_gpus, spec, launch_t)
        except (RanksGone, ValueError) as exc:
            log.warning("no resize in place run_key=%s: newcomers could not start (%s: %s)", spec.run_key,
                        type(exc).__name__, exc)
            self.transport.end(joiners, 0.0)
            return False
        ended, self.round = self.round, self.round + 1
        word = plan.word(self.round, orders, len(self.ranks))
        try:
            self.transport.tell(self.ranks, {spec_file(self.round): spec.model_dump_json(),
                                             next_file(ended): word.model_dump_json()})
            self.transport.hand_over(joiners, orders[len(plan.stay):], spec, self.round, joins=True)
        except RanksGone as exc:
            # Some ranks may be forming the new group already: a crash, as a
            # rank lost at any other moment; the run goes on from its checkpoint.
            self.transport.end(self.ranks + joiners, 0.0)
            self.paused, self.died = None, True
            self.start_error = f"a rank was lost while the ranks regrouped: {exc}"
            return True
        leavers = [self.ranks[r] for r in plan.leaving]
        self.ranks, self.orders, self.launch_t = ranks, orders, launch_t
        self.spec, self.gpus, self.slots = spec, new_gpus, new_slots
        self.paused, self._stop_sent = None, False
        self.transport.end(leavers, LEAVE_S)
        log.debug("segment resized in place run_key=%s round=%d gpus=%s (%d stay, %d join, %d leave)",
                 spec.run_key, self.round, new_gpus, len(plan.stay), len(joiners), len(leavers))
        return True

    def release(self) -> SegmentResult | None:
        """A paused segment that does not go on in place: its ranks save
        where they stand and end; their last result (None if they could not
        say). Asked again, the same result: the ranks may be let go inside
        the segment's task and the record read by the loop after it."""
        if self.paused is None:
            return self._released
        self.paused = None
        try:
            self.transport.tell(self.ranks, {next_file(self.round): Next(round=self.round, action="save")
                                             .model_dump_json()})
            said = self.transport.result(self.ranks, self.round, RELEASE_S)
        except RanksGone as exc:
            said = None
            log.warning("paused ranks did not save and end run_key=%s: %s", self.spec.run_key, exc)
        finally:
            self.transport.end(self.ranks, 0.0)
        if not said:
            return None
        self._released = self._result(said)
        return self._released

    def request_stop(self) -> None:
        """Every rank stops at the next iteration boundary, with a checkpoint (as on SIGTERM)."""
        self.transport.stop(self.ranks, terminate=True)

    def kill(self, grace_s: float = 5.0) -> None:
        """Ask for a stop, and end whatever is still there `grace_s` later."""
        self.request_stop()
        self.transport.end(self.ranks, grace_s)

    def wait(self, on_progress: ProgressCallback | None = None, timeout_s: float | None = None) -> SegmentResult:
        """Until every rank is done (its result), one failed (a crash, the
        others ended), or they paused at a stop (`in_place`).

        `timeout_s`: for segments that must end on their own (a profile), a hang
        (a rendezvous that never completes, a stuck collective) is reported as a
        crash with the ranks' logs instead of blocking the caller for ever."""
        try:
            return self._wait(on_progress, timeout_s)
        finally:
            self.transport.after(self.ranks, self.paused is not None)

    def _wait(self, on_progress: ProgressCallback | None, timeout_s: float | None) -> SegmentResult:
        if self.start_error:
            log.warning("segment could not start run_key=%s: %s", self.spec.run_key, self.start_error)
            return crashed(self.gpus, self.launch_t, self.start_error)
        give_up = None if timeout_s is None else time.time() + timeout_s
        while True:
            done, failures = self.transport.watch(self.ranks, self.launch_t)
            paused = self._progress(on_progress)
            if failures:
                # Survivors are stuck in a collective with a dead peer: no point
                # in a graceful stop, the last checkpoint is what we resume from
                # (once what the cause said is read: a Ray rank's log goes with it).
                self.died = any(f.how is Failure.DIED for f in failures)
                result, cause = crash_result(self.gpus, self.launch_t, failures,
                                             lambda f: self.transport.log_tail(self.ranks, f))
                self.transport.end(self.ranks, 0.0)
                log.warning("segment crashed run_key=%s rank=%d node=%s how=%s (%s)", self.spec.run_key, cause.rank,
                            cause.node, cause.how.value, cause.detail)
                return result
            if paused is not None:  # the ranks wait for `regroup` or `release`
                self.paused = paused
                return paused
            if done:
                said = self.transport.result(self.ranks, self.round, 0.0)
                self._progress(on_progress)
                if said is None:
                    return crashed(self.gpus, self.launch_t, "the ranks ended without a result")
                return self._result(said)
            if give_up is not None and time.time() > give_up:
                logs = " | ".join(f"rank {r}: {self.transport.log_tail(self.ranks, RankFailure(r, Failure.FAILED, ''))[-600:]}"
                                  for r in range(len(self.ranks)))
                self.kill(grace_s=2.0)
                log.warning("segment timed out run_key=%s after=%.0fs", self.spec.run_key, timeout_s)
                return crashed(self.gpus, self.launch_t, f"did not finish in {timeout_s:.0f} s: {logs}")
            self._forward_stop()
            self.transport.idle(self.ranks, self.transport.poll_s / 4 if self._pause_near() else self.transport.poll_s)

    def _progress(self, on_progress: ProgressCallback | None) -> SegmentResult | None:
        """Forward rank 0's new progress lines; its result if the ranks paused."""
        lines, said = self.transport.progress(self.ranks[0], self.round)
        for line in lines:
            self._iteration = line.iteration
            if on_progress:
                on_progress(line)
        if not said or not self.spec.in_place:
            return None
        result = self._result(said)
        return result if result.paused else None

    def _forward_stop(self) -> None:
        """The scheduler's stop for this round, to every rank: rank 0 weighs it at its next boundary."""
        command = self.control.pending(self.spec.applied_seq) if self.control and not self._stop_sent else None
        if command is not None:
            self.transport.stop(self.ranks, terminate=False, seq=command.seq)
            self._stop_sent = True

    def _pause_near(self) -> bool:
        """The ranks are about to pause (a stop was sent, or the segment's
        last iteration is near): a resize in place waits for the flow to
        notice, so it looks four times as often then."""
        return self.spec.in_place and (self._stop_sent or self._iteration >= self.spec.stop_at - 2)

    def _result(self, said: str) -> SegmentResult:
        result = SegmentResult.model_validate_json(said)
        result.gpus = self.gpus
        return result
