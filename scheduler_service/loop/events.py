"""What the control loop is told: everything that happens to runs and to
the cluster, from whoever drives it (the Prefect worker, or the simulator's
backend). Plain frozen records; the loop never reads a file, a clock or an
API, so both drivers feed it the same facts.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_service.contracts import RejectionReason
from scheduler_service.policy import Job, Topology


@dataclass(frozen=True, slots=True)
class Arrived:
    """A run to decide, with its throughput curve. `job.deadline` is the
    user's (None: best-effort); the loop derives the plan deadline."""

    run_id: str
    job: Job
    at: float  # when it was taken in: its window, for the safety margin, counts from here
    # Its curve is partial: measured on at most this many GPUs while the others were busy, fewer than the model
    # could use here. Its widest count is then not the model's: a run that needs more is not refused for it.
    measured_up_to: int | None = None


@dataclass(frozen=True, slots=True)
class Adopted:
    """A run an earlier life of the service admitted, found again after a
    restart: on the GPUs its control channel says it may be using (running),
    or still waiting for GPUs. `job.deadline` is the user's."""

    run_id: str
    job: Job
    share: int | None
    running: bool
    held: tuple[int, ...] = ()  # acknowledged, or commanded and not acknowledged yet
    commanded: tuple[int, ...] = ()  # the last GPU set it was told to use
    pending_seq: int | None = None  # that command, if not acknowledged yet
    last_seq: int = 0  # the newest command on its channel: the next one follows it
    cancelled: bool = False  # cancelled while no worker watched: it is only to be stopped
    since: float = 0.0  # when its last (re)start began


@dataclass(frozen=True, slots=True)
class StartsRecalled:
    """How long the last starts took, launch to first iteration, as an
    earlier life of the service saw them (oldest first): a restarted service
    plans with what it learnt of starts here, not with the default."""

    took_s: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class Progress:
    """What a running run last reported (its rank 0's status)."""

    run_id: str
    iteration: int
    gpus: tuple[int, ...] = ()  # the GPU set it reported from
    iterations_per_s: float | None = None  # its own recent rate
    projected_finish: float | None = None  # its own projection, while the loop has seen too little
    save_error: str | None = None  # while its checkpoint saves fail: it cannot be resized or parked


@dataclass(frozen=True, slots=True)
class Acknowledged:
    """The run applied command `seq`: it now runs on `gpus` (none: parked or stopped)."""

    run_id: str
    seq: int
    gpus: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Ended:
    """The run's process exited, or it left before it was launched
    (cancelled or deleted while it waited): every GPU it had is free."""

    run_id: str


@dataclass(frozen=True, slots=True)
class Leaving:
    """A running run was cancelled and Prefect is stopping its process: it
    gets no GPU and gives none up while it ends (a grow sent now would be
    told on the page of a run that is going)."""

    run_id: str


@dataclass(frozen=True, slots=True)
class CancelRequested:
    """A running run was cancelled and nothing else stops it: tell it to stop."""

    run_id: str


@dataclass(frozen=True, slots=True)
class ClusterChanged:
    """Nodes joined, left or died. `mapping` takes each old GPU id that still
    exists to its new one (ids are positions in the topology)."""

    topology: Topology
    mapping: dict[int, int]
    lost_nodes: tuple[str, ...] = ()  # the nodes gone, by name, for what runs that had GPUs there are told


@dataclass(frozen=True, slots=True)
class Reserved:
    """The service itself holds these GPUs (profiling a new model): no run is
    launched or grown onto them until they are given back."""

    holder: str
    gpus: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Unreserved:
    holder: str


@dataclass(frozen=True, slots=True)
class ProfileFailed:
    """A run waiting for its model's profile will not get one: the
    measurement failed (the user's model raised), or no GPUs were free to
    measure on within the profiling timeout. The loop rejects it."""

    run_id: str
    reason: RejectionReason
    message: str


Event = (Arrived | Adopted | StartsRecalled | Progress | Acknowledged | Ended | Leaving | CancelRequested
         | ClusterChanged | Reserved | Unreserved | ProfileFailed)
