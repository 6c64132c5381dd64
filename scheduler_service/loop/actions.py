"""What the control loop decides: every action a driver must carry out or
show. The service turns them into control-channel commands, launches, store
rows and Prefect states, labels and events; the simulator's backend into
simulated delays. Times are on the driver's clock (the user's deadlines).
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_service.contracts import AllocationAction, RejectionReason


@dataclass(frozen=True, slots=True)
class Admitted:
    """The run is admitted: guaranteed to meet its deadline (with its MSS as
    `share`), or best-effort."""

    run_id: str
    guaranteed: bool
    share: int | None
    message: str
    guaranteed_finish: float | None  # when its plan completes, if guaranteed
    gpus_now: int  # what the plan gives it from now on
    decision_s: float  # the policy call's wall time
    # Re-planned, not decided: a run an earlier life of the service admitted, or
    # every run after a change of nodes. Its decision and its phase stand (a
    # running run stays running in the store); only its share may change.
    replanned: bool = False


@dataclass(frozen=True, slots=True)
class Rejected:
    """The run is not admitted; `earliest_feasible_deadline` is on the user's
    clock: a deadline that would have been admitted now."""

    run_id: str
    reason: RejectionReason
    message: str
    earliest_feasible_deadline: float | None
    decision_s: float | None  # None: not the policy's (a profile that failed)


@dataclass(frozen=True, slots=True)
class GuaranteeLost:
    """An admitted run the policy can no longer guarantee (the cluster shrank,
    or a restarted service found it late), or one that can no longer make its
    deadline at the speed it shows, even on every GPU it may have: it carries
    on best-effort, and is told at once, with when it should finish."""

    run_id: str
    projected_finish: float | None = None


@dataclass(frozen=True, slots=True)
class Command:
    """A control-channel command for the run: move to `gpus` (an empty set
    parks it, or stops it), numbered `seq` on its channel."""

    run_id: str
    seq: int
    gpus: tuple[int, ...] = ()

    kind = AllocationAction.RESCALE
    channel_action = "rescale"


@dataclass(frozen=True, slots=True)
class Launch(Command):
    """Start the run's flow process on `gpus` (it reads its first command there)."""

    kind = AllocationAction.LAUNCH


@dataclass(frozen=True, slots=True)
class Rescale(Command):
    """The running run moves to `gpus`: the new ones are claimed now, the
    ones it leaves stay held until it acknowledges."""

    kind = AllocationAction.RESCALE


@dataclass(frozen=True, slots=True)
class Park(Command):
    """The run checkpoints and holds nothing until its new set is free."""

    kind = AllocationAction.PARK


@dataclass(frozen=True, slots=True)
class Stop(Command):
    """The run was cancelled: it checkpoints and ends."""

    kind = AllocationAction.STOP
    channel_action = "stop"


@dataclass(frozen=True, slots=True)
class HoldsNoGpus:
    """The run acknowledged giving up every GPU (parked or stopped); still alive."""

    run_id: str


@dataclass(frozen=True, slots=True)
class GpusFreed:
    """The run's process ended (or it left before it was launched): its GPUs are free."""

    run_id: str
    launched: bool  # it had been launched (a history row and an outcome to tell)
    iteration: int  # where it got to
    iterations: float  # of its total


@dataclass(frozen=True, slots=True)
class Await:
    """An admitted run not launched yet: placed on GPUs not free yet, or none spare."""

    run_id: str
    placed: bool


@dataclass(frozen=True, slots=True)
class RiskChanged:
    """A running deadline run's outlook flipped: its projected finish came
    within its at-risk margin of the deadline, or is back beyond it."""

    run_id: str
    at_risk: bool
    projected_finish: float | None
    deadline: float


@dataclass(frozen=True, slots=True)
class Rebased:
    """The cluster changed under the run: it now holds `held`, by the GPUs'
    new ids (an id is a position in the topology, so a node gone or joined
    moves them). Every record of what it holds must follow, or a GPU it no
    longer has is given to another run while the records still say it is
    this one's. `lost`: it had GPUs on a node that is gone (`nodes`): it lost
    its ranks, and goes on from its last checkpoint where the next plan puts it."""

    run_id: str
    held: tuple[int, ...]
    lost: bool
    nodes: tuple[str, ...] = ()  # the nodes gone, when it lost GPUs there


@dataclass(frozen=True, slots=True)
class Started:
    """A run reached its first iteration `took_s` after its launch: what the
    driver keeps for the service's next life (`StartsRecalled`)."""

    run_id: str
    took_s: float


@dataclass(frozen=True, slots=True)
class StartedSlowly:
    """A run took far longer from launch to its first iteration than the
    plans charge: admitted runs with tight deadlines may miss theirs. New
    runs now keep `kept_s` for a start."""

    run_id: str
    took_s: float
    charged_s: float
    kept_s: float


@dataclass(frozen=True, slots=True)
class ProfileNeeded:
    """The run cannot be decided on its curve, which was measured on only
    `measured_up_to` GPUs while the others were busy: the loop would refuse
    it for want of counts never measured. Its curve is to be completed on a
    wider block, then it arrives again; it is no longer the loop's meanwhile."""

    run_id: str
    measured_up_to: int


Action = (Admitted | Rejected | ProfileNeeded | GuaranteeLost | Launch | Rescale | Park | Stop | HoldsNoGpus | GpusFreed
          | Await | RiskChanged | Rebased | Started | StartedSlowly)
