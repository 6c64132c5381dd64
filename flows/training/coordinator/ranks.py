"""Where a run's ranks run, chosen once per run (`ranks_for`): local processes
with the warm standby pool, or Ray actors on the nodes of each placement with
the run's actor pool. The training loop talks to either through `Ranks` and
the segments it makes (`supervision.RunningSegment`), never asking which.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from flows.training.control import FileControlChannel, GpuSlot
from flows.training.launch.identity import RankIdentity
from flows.training.coordinator.launcher import POOL, local_segment, prune_segment_dirs
from flows.training.coordinator.segment_machine import Segment
from flows.training.segment import SegmentSpec
from flows.training.launch.standby import WorkerPool
from flows.training.supervision import RunningSegment

KEEP_SEGMENT_DIRS = 5  # a local run's newest segment folders (logs, progress, result) kept for a post-mortem


class Ranks(Protocol):
    in_place: bool  # its segments pause at a stop and resize in place (segment_machine.Segment.regroup)

    def segment(self, spec: SegmentSpec, gpus: list[int], placement: list[GpuSlot] | None) -> RunningSegment:
        """The next segment on `gpus` (on a cluster, the slots `placement` names), not started yet."""

    def refill(self, upcoming: list[int]) -> None:
        """The current segment trains: warm ranks for the next one, on the GPUs `upcoming` it will likely want
        (earlier, their imports would only slow this segment's start)."""

    def lost_nodes(self) -> list[str]:
        """After a crash: the nodes of the last segment that are gone (then
        the run waits for the scheduler to place it anew)."""

    def close(self) -> None:
        """The run is over: let the warm ranks go."""


class LocalRanks:
    """Every rank a process on this machine, on loopback; relaunches take
    warm standbys from the process's `WorkerPool`; resizes keep the ranks on
    GPUs that stay."""

    in_place = True

    def __init__(self, segments_dir: Path, pool: WorkerPool = POOL, identity: RankIdentity | None = None) -> None:
        self.segments_dir, self.pool, self.identity = segments_dir, pool, identity

    def segment(self, spec: SegmentSpec, gpus: list[int], placement: list[GpuSlot] | None) -> Segment:
        prune_segment_dirs(self.segments_dir, keep=KEEP_SEGMENT_DIRS - 1)  # and this one makes the count
        return local_segment(spec, gpus, self.segments_dir, self.pool, self.identity)

    def refill(self, upcoming: list[int]) -> None:
        self.pool.refill(len(upcoming))

    def lost_nodes(self) -> list[str]:
        return []  # this machine is where the flow process runs: it is not lost while we ask

    def close(self) -> None:
        """Standbys stay: they exit with the flow process (EOF on their stdin),
        and a next run in the same process (tests, benchmarks) takes them."""


def ranks_for(
    ray_address: str | None, run_key: str, channel: FileControlChannel, identity: RankIdentity | None = None
) -> Ranks:
    """Ray actors when the run was launched on a Ray cluster, else local
    processes (as `identity`'s account, when given)."""
    if ray_address:
        from flows.training.ray_nodes import loopback_before_import

        loopback_before_import(ray_address)  # before `ray` is imported, below
        from flows.training.coordinator.ray_ranks import RayRanks

        return RayRanks(ray_address, run_key)
    return LocalRanks(channel.folder / "segments", identity=identity)
