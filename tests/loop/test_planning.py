"""When the loop asks the policy: at once for arrivals, and at a slot
boundary only when something the last plan rested on changed, as the
simulator's ideal engine does; never at a boundary where nothing did."""

from __future__ import annotations

from scheduler_service.loop import ControlLoop
from scheduler_service.loop.actions import Admitted, Launch
from scheduler_service.loop.events import Ended
from scheduler_service.policy import (
    Decision, Job, SchedulingPolicy, SchedulingReply, SchedulingRequest, ThroughputCurve, Topology,
)
from tests.loop.driver import SETTINGS, T0, Driver, job

CURVE = ThroughputCurve({1: 10.0, 2: 19.0})


def _counted(d: Driver) -> list[float]:
    """The times the loop's policy is asked."""
    calls: list[float] = []
    schedule = d.loop.policy.schedule

    def counting(request):  # type: ignore[no-untyped-def]
        calls.append(request.now)
        return schedule(request)

    d.loop.policy.schedule = counting  # type: ignore[method-assign]
    return calls


def _training(d: Driver, run_id: str, start: float, until: float, rate: float = 19.0) -> None:
    """It reports progress at `rate` every poll from `start` to `until`, and the loop is stepped."""
    now = start
    while now < until:
        d.report(run_id, now, int((now - start) * rate), d.commands[run_id].gpus, rate=rate)
        d.step(now)
        now += 1.0


def test_a_run_on_its_plan_is_not_re_planned_at_every_slot() -> None:
    d = Driver()
    calls = _counted(d)
    d.arrive(job("a", T0, 19 * 100, T0 + 600, CURVE))
    d.step(T0)
    d.ack("a", T0)
    _training(d, "a", T0, T0 + 60)
    assert calls == [T0]  # 30 slot boundaries, nothing changed: no call


def test_an_end_is_planned_at_the_next_slot_and_an_arrival_at_once() -> None:
    d = Driver()
    calls = _counted(d)
    d.arrive(job("a", T0, 19 * 100, T0 + 600, CURVE))
    d.arrive(job("b", T0, 10 * 300, T0 + 600, CURVE))
    d.step(T0)
    d.handle(Ended("b"), T0 + 0.5)
    d.step(T0 + 1)
    assert calls == [T0]  # mid-slot: the end waits for the boundary
    d.step(T0 + 2)
    assert calls == [T0, T0 + 2]
    d.arrive(job("c", T0 + 2.5, 100, T0 + 600, CURVE))
    assert "c" in d.new(d.step(T0 + 2.5), Admitted) and calls == [T0, T0 + 2, T0 + 2.5]


def test_a_run_that_falls_a_slot_behind_its_plan_is_re_planned() -> None:
    d = Driver()
    calls = _counted(d)
    d.arrive(job("a", T0, 19 * 100, T0 + 600, CURVE))
    d.step(T0)
    d.ack("a", T0)
    _training(d, "a", T0, T0 + 20, rate=0.0)  # stuck: no iteration for 20 s, its rate unknown
    assert len(calls) > 1 and calls[1] <= T0 + 6  # a slot (2 s) of work behind, and a plan soon after


def test_a_run_slower_than_its_profile_is_re_planned_with_its_speed() -> None:
    d = Driver()
    calls = _counted(d)
    d.arrive(job("a", T0, 19 * 1000, T0 + 6000, CURVE))
    d.step(T0)
    d.ack("a", T0)
    _training(d, "a", T0, T0 + 10, rate=9.5)  # half its profile
    assert len(calls) > 1 and d.loop.runs["a"].speed_ratio < 0.9


def test_the_policy_is_asked_again_when_it_asked_to_be_woken() -> None:
    """A plan that widens later (or a baseline's time slice) asks to be woken: then, and not before."""
    d = Driver()
    calls = _counted(d)
    schedule = d.loop.policy.schedule

    def waking(request):  # type: ignore[no-untyped-def]
        reply = schedule(request)
        reply.wake_at = T0 + 20 if request.now < T0 + 20 else None
        return reply

    d.loop.policy.schedule = waking  # type: ignore[method-assign]
    d.arrive(job("a", T0, 19 * 100, T0 + 600, CURVE))
    d.step(T0)
    d.ack("a", T0)
    _training(d, "a", T0, T0 + 40)
    assert calls == [T0, T0 + 20]


class _HoldsBackUntilDue(SchedulingPolicy):
    """Admits every run and gives it GPUs only once its deadline has passed
    (as ElasticFlow leaves a run its plan no longer carries, until it
    carries it on best-effort): whether the loop asks again then."""

    name = "holds-back"

    def __init__(self, topology: Topology) -> None:
        super().__init__(topology, interval=SETTINGS.interval_s)
        self.jobs: dict[str, Job] = {}

    def schedule(self, request: SchedulingRequest) -> SchedulingReply:
        for job_id in request.finished:
            self.jobs.pop(job_id, None)
        decisions = []
        for arrival in request.arrivals:
            self.jobs[arrival.job_id] = arrival
            decisions.append(Decision(job_id=arrival.job_id, admitted=True, guaranteed=True, share=1))
        alloc = {j: (self.topology.num_gpus if job.deadline is not None and job.deadline <= request.now else 0)
                 for j, job in self.jobs.items()}
        return self.reply(request, decisions, alloc, self.jobs)


def test_a_run_that_holds_nothing_is_planned_again_once_its_deadline_passes() -> None:
    """A CI burst: a run parked when its plan fell short held nothing and sat
    beside idle GPUs past its deadline, for nothing made the loop ask again."""
    d = Driver()
    d.loop = ControlLoop(Topology(1, 1, 2), SETTINGS, policy_for=_HoldsBackUntilDue)
    calls = _counted(d)
    d.arrive(job("a", T0, 1000, T0 + 5, CURVE))
    assert not d.new(d.step(T0), Launch)
    for now in (T0 + 1, T0 + 2, T0 + 3):
        assert not d.new(d.step(now), Launch)
    # Its deadline on the plan's scale is T0 + 3 (a slot of margin kept): the first boundary after it.
    launched = d.new(d.step(T0 + 4), Launch)
    assert calls == [T0, T0 + 4] and launched["a"].gpus == (0, 1)


def test_a_lasting_gap_from_the_profile_is_what_the_next_runs_of_the_model_are_planned_with() -> None:
    """Issue 42: the profile's speed and the speed runs really train at are
    compared as they train; a gap that lasts (three slots in a row) is what
    the model's next runs are admitted on, and it closes again when runs
    train at their profile once more. A model is never planned faster than
    it was measured."""
    from scheduler_service.loop.actions import Rejected
    from scheduler_service.policy import Job, ThroughputCurve

    curve = ThroughputCurve({1: 20.0, 2: 36.0})

    def resnet(run_id: str, at: float, iterations: float, deadline: float | None) -> Job:
        return Job(run_id, at, iterations, deadline, curve, model="resnet", batch_size=32)

    def trains(d: Driver, run_id: str, start: float, seconds: int, rate: float) -> float:
        done = 0.0
        for second in range(1, seconds + 1):
            done += rate
            d.report(run_id, start + second, int(done), (0, 1), rate=rate)
            d.step(start + second)
        d.handle(Ended(run_id), start + seconds + 1)
        d.step(start + seconds + 1)
        return start + seconds + 2

    d = Driver()
    d.arrive(resnet("slow", T0, 100_000, None))
    d.step(T0)
    d.ack("slow", T0)
    now = trains(d, "slow", T0, 40, 36 * 0.6)  # 60% of its profile, slot after slot
    d.arrive(resnet("next", now, 3000, now + 110))  # 83 s at the profile's speed, 139 s at the speed seen
    (rejected,) = d.new(d.step(now), Rejected).values()
    assert rejected.earliest_feasible_deadline is not None and rejected.earliest_feasible_deadline > now + 139

    d.arrive(resnet("fast", now + 1, 100_000, None))
    d.step(now + 1)
    d.ack("fast", now + 1)
    now = trains(d, "fast", now + 1, 40, 36.0)  # back at its profile
    d.arrive(resnet("again", now, 3000, now + 110))
    assert "again" in d.new(d.step(now), Admitted)
