"""Supervising a segment, whichever transport carries its ranks: the
interface the training loop drives (`coordinator.segment_machine.Segment`
implements it), and what the ranks and the coordinator share: how long a
rank may take to take its part, how rank 0's progress is read, and which
failed rank a crash report blames.

No torch, no Ray: the rank processes and the Ray actors import it too.
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Callable, NamedTuple, Protocol

from flows.training.control import GpuSlot
from flows.training.orders import RankOrder
from flows.training.segment import SegmentResult, SegmentSpec, SegmentTimings

# Launch -> every rank has taken its part (local: opened its segment's log;
# Ray: said where it runs); else the segment failed. A rank that is not a warm
# standby imports torch and torch._dynamo first (~4 s of CPU; up to a minute
# when several start at once on two busy cores, and on Ray its actor's process
# starts on its node first). The ranks that did start wait for the late one
# in their rendezvous for `SegmentSpec.init_timeout_s` (120 s) and then fail
# anyway, so waiting longer only delays the crash report; waiting less would
# fail slow but healthy starts on a busy machine.
HANDOVER_S = 120.0

PROGRESS_FILE = "progress.jsonl"  # rank 0 appends one line per iteration


class ProgressLine(NamedTuple):
    """One iteration as rank 0 reports it: its index, the global mean loss,
    when it ended, and while checkpoint saves fail, why (saving.py)."""

    iteration: int
    loss: float
    t: float
    save_error: str | None = None

    def json(self) -> str:
        return json.dumps(self._asdict())


ProgressCallback = Callable[[ProgressLine], None]


def read_progress(folder: Path, offset: int) -> tuple[list[ProgressLine], int]:
    """Rank 0's complete progress lines in `folder` from byte `offset` on, and
    the offset after them (a line being written is left for the next read)."""
    path = folder / PROGRESS_FILE
    if not path.exists():
        return [], offset
    with open(path, "rb") as fh:
        fh.seek(offset)
        data = fh.read()
    complete = data[: data.rfind(b"\n") + 1]
    lines = [ProgressLine(**json.loads(line)) for line in complete.splitlines() if line.strip()]
    return lines, offset + len(complete)


class RunningSegment(Protocol):
    """One launch of a run's ranks, as the training loop drives it."""

    gpus: list[int]
    orders: list[RankOrder]  # what each rank was told, once started

    def start(self) -> None:
        """Hand every rank its part; ranks that cannot start make `wait` report a crash."""

    def wait(self, on_progress: ProgressCallback | None = None, timeout_s: float | None = None) -> SegmentResult:
        """Until every rank is done (its result) or one failed (a crash, the others killed)."""

    def request_stop(self) -> None:
        """Every rank stops at the next iteration boundary, with a checkpoint (as on SIGTERM)."""

    def regroup(self, spec: SegmentSpec, gpus: list[int], placement: list[GpuSlot] | None = None) -> bool:
        """After `wait` said `paused`: go on in place on `gpus` (on a cluster,
        the slots `placement` names); False: it cannot, `release` it."""

    def release(self) -> SegmentResult | None:
        """After `wait` said `paused`: its ranks save where they stand and exit; their result (again if asked again)."""

    def kill(self, grace_s: float = 5.0) -> None:
        """Ask for a stop, and end whatever is still there `grace_s` later."""

    @property
    def pids(self) -> list[int]:
        """The ranks' processes (on their nodes, on a cluster)."""


class Failure(Enum):
    """How a rank failed, the likeliest cause of a crash first. When one rank
    dies, the others fail in their next collective with a closed peer: they
    are casualties, and the report must name the rank that went first."""

    DIED = "died"  # killed by a signal, or its process or node gone
    NEVER_TOOK = "never took its segment"  # gone before it had its part, or not started in HANDOVER_S
    FAILED = "failed"  # exited with an error, or raised one
    ABORTED = "aborted"  # SIGABRT: gloo's C++ terminate as soon as a peer's socket closes


@dataclass(frozen=True, slots=True)
class RankFailure:
    rank: int
    how: Failure
    detail: str  # short: "exited with -9", "died: RayActorError"
    node: str | None = None  # on a cluster
    message: str = ""  # the error the rank raised, if it did (its log's tail comes on top)

    @property
    def who(self) -> str:
        return f"rank {self.rank}" + (f" on {self.node}" if self.node else "")


def exit_failure(rank: int, code: int | None, took: bool) -> RankFailure:
    """A local rank process's failure, from its exit code (None: still running)
    and whether it took its segment."""
    if not took:
        return RankFailure(rank, Failure.NEVER_TOOK, f"never took its segment (exit code {code})")
    if code == -signal.SIGABRT:
        how = Failure.ABORTED
    elif code is not None and code < 0:
        how = Failure.DIED
    else:
        how = Failure.FAILED
    return RankFailure(rank, how, f"exited with {code}")


_LIKELIEST = list(Failure)


def cause_of(failures: list[RankFailure]) -> RankFailure:
    """The rank to blame: the likeliest kind of failure, the lowest rank among those."""
    return min(failures, key=lambda f: (_LIKELIEST.index(f.how), f.rank))


def crash_result(gpus: list[int], launch_t: float, failures: list[RankFailure],
                 tail: Callable[[RankFailure], str]) -> tuple[SegmentResult, RankFailure]:
    """The crashed segment's result, naming the cause, every failed rank and
    the tail of the cause's log; and the cause."""
    cause = cause_of(failures)
    failed = ", ".join(f"{f.who}: {f.detail}" for f in sorted(failures, key=lambda f: f.rank))
    said = f": {cause.message}" if cause.message else ""
    error = f"worker {cause.who} {cause.detail}{said} (failed: {failed}): {tail(cause)}"
    return crashed(gpus, launch_t, error, cause.how), cause


def crashed(gpus: list[int], launch_t: float, error: str, failure: Failure | None = None) -> SegmentResult:
    """A segment that ended without a result of its own: the run resumes from its last checkpoint."""
    return SegmentResult(gpus=gpus, start_iteration=-1, end_iteration=-1, reason="crashed",
                         timings=SegmentTimings(launch_t=launch_t, end_t=time.time()), error=error,
                         failure=failure.value if failure is not None else None)

