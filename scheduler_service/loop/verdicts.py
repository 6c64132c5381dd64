"""What a run is told of the policy's decision on it: admitted with its
share, or refused with the reason that actually failed (the policy sees the
plan's deadline; the user gave another, and a start here costs time the
policy does not see). Pure functions of the run and the decision."""

from __future__ import annotations

from scheduler_service.contracts import RejectionReason
from scheduler_service.loop.actions import Admitted, Rejected
from scheduler_service.loop.run import LoopRun
from scheduler_service.policy import Decision


def short_of_measurement(run: LoopRun, decision: Decision) -> bool:
    """Whether the policy refused the run only for GPU counts its partial
    curve never measured: a busy moment at profiling is not the model's
    limit, so it is measured on more GPUs rather than refused (issue 42:
    every resnet run after one profiled beside a busy slot was refused
    as "even the whole cluster at 1 GPUs cannot finish")."""
    return run.measured_up_to is not None and decision.reason in (RejectionReason.INFEASIBLE_ALONE,
                                                                  RejectionReason.NO_USABLE_GPU_COUNT)


def admitted(run: LoopRun, decision: Decision, gpus_now: int, seconds: float) -> Admitted:
    return Admitted(run.run_id, decision.guaranteed, decision.share, decision.message,
                    decision.guaranteed_finish, gpus_now, seconds, replanned=run.adopted)


def rejected(run: LoopRun, decision: Decision, now: float, seconds: float, startup_s: float) -> Rejected:
    """The policy's rejection on the user's clock, saying what actually
    failed: a deadline the work alone would meet but a start here (and
    the room kept for safety) would not has its own reason, whether the
    policy saw the plan deadline passed or too close for any plan; an
    infeasible run is told which GPU counts it can use."""
    reason = decision.reason or RejectionReason.REJECTED
    message = decision.message
    work_s = work_alone_s(run)
    if reason in (RejectionReason.DEADLINE_PASSED, RejectionReason.INFEASIBLE_ALONE) \
            and run.deadline is not None and work_s is not None and now + work_s <= run.deadline:
        reason = RejectionReason.SOONER_THAN_START_UP
        message = (f"the deadline is {run.deadline - now:.0f} s away and its {run.job.iterations:.0f} iterations "
                   f"take about {work_s:.1f} s, but a run takes about {startup_s:.0f} s to start here (launch to "
                   f"first iteration, as measured), and {run.margin.of(run.deadline - run.taken_in_at):.0f} s "
                   "more are kept for safety")
    elif reason in (RejectionReason.INFEASIBLE_ALONE, RejectionReason.NO_USABLE_GPU_COUNT):
        levels = run.job.curve.levels if run.job.curve.speed(1) > 1e-6 else ()
        usable = ", ".join(map(str, levels)) or "none"
        message += (f" (usable GPU counts at global batch {run.job.batch_size}: {usable}; a run uses no more "
                    "GPUs than samples in its global batch, and only counts where its measured speed grows)")
    elif run.deadline is not None and startup_s:
        message += f" (a run takes about {startup_s:.0f} s to start here)"
    earliest = decision.earliest_feasible_deadline
    return Rejected(run.run_id, reason, message, None if earliest is None else run.to_user_time(earliest), seconds)


def work_alone_s(run: LoopRun) -> float | None:
    """Seconds its iterations take at its widest measured count, with no start: None if it has no speed."""
    curve = run.job.curve
    levels = curve.levels
    speed = curve.speed(levels[-1]) if levels else 0.0
    return run.job.iterations / speed if speed > 1e-9 else None
