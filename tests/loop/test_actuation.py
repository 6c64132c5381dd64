"""The control loop's GPU bookkeeping, through its interface: the policy's
placement becomes launches and commands, and a GPU changes holder only after
its old holder acknowledged giving it up."""

from __future__ import annotations

from scheduler_service.loop.actions import Admitted, Launch, Park, HoldsNoGpus, Rescale, Stop
from scheduler_service.loop.events import (
    Acknowledged,
    Adopted,
    CancelRequested,
    Ended,
    Leaving,
    Progress,
    Reserved,
    Unreserved,
)
from tests.loop.driver import T0, Driver, job


def _alone_on_both() -> Driver:
    """A loop whose one run, "a", trains on both GPUs."""
    d = Driver()
    d.arrive(job("a", T0, 4000, T0 + 600))
    d.step(T0)
    d.ack("a", T0)
    return d


def test_an_admitted_run_launches_on_its_placement_with_its_first_command() -> None:
    d = Driver()
    d.arrive(job("a", T0, 4000, T0 + 600))
    admitted, launch = d.step(T0)
    assert isinstance(admitted, Admitted) and admitted.guaranteed and admitted.share == 1
    assert isinstance(launch, Launch) and launch.gpus == (0, 1) and launch.seq == 1
    assert d.step(T0 + 0.5) == []  # nothing new: no plan before the next slot, nothing to move


def test_gpus_change_hands_only_after_the_old_holder_acknowledged() -> None:
    d = _alone_on_both()
    # b needs one GPU from now on to make its deadline: a shrinks to one.
    d.arrive(job("b", T0 + 2, 20 * 36, T0 + 2 + 44))
    now, actions = T0 + 2, d.step(T0 + 2)
    assert d.new(actions, Admitted)["b"].share == 1
    while "a" not in d.new(actions, Rescale) and now < T0 + 12:
        now += 2
        actions = d.step(now)
    shrink = d.new(actions, Rescale)["a"]
    assert len(shrink.gpus) == 1
    assert d.kinds(now)["b"] == ["Await"]  # a still holds both GPUs until it acknowledges
    d.ack("a", now, iteration=100)
    launch = d.new(d.step(now), Launch)["b"]
    assert set(launch.gpus).isdisjoint(shrink.gpus)
    assert sorted(d.loop.gpu_map().values()) == ["a", "b"]
    d.handle(Ended("b"), now + 1)
    grow = d.new(d.step(now + 2), Rescale)["a"]  # b ended: a grows back at the next slot
    assert grow.gpus == (0, 1)


def test_a_run_told_to_stop_holds_its_gpus_until_it_acknowledges_and_is_never_commanded_again() -> None:
    d = _alone_on_both()
    (stop,) = d.handle(CancelRequested("a"), T0 + 1)
    assert isinstance(stop, Stop) and stop.seq == 2
    assert d.handle(CancelRequested("a"), T0 + 1) == []  # once: a second request sends nothing more
    d.arrive(job("b", T0 + 2, 36 * 60, T0 + 2 + 70))  # needs both GPUs: only if "a" no longer counts
    assert d.kinds(T0 + 2) == {"b": ["Admitted", "Await"]}  # "a" still holds both
    assert d.commands["a"] == stop  # no rescale or park supersedes the stop
    assert isinstance(d.ack("a", T0 + 2)[0], HoldsNoGpus)
    assert "b" in d.new(d.step(T0 + 2), Launch)
    (release,) = d.handle(Ended("a"), T0 + 3)
    assert release.launched  # type: ignore[union-attr]
    assert d.handle(CancelRequested("a"), T0 + 4) == []


def test_a_run_prefect_is_stopping_is_neither_grown_nor_shrunk_and_can_still_be_told_to_stop() -> None:
    """A cancelled run shrank for another; that one ended just as Prefect
    began stopping the first. The page of a run being cancelled said
    "resized: now on 2 GPUs" after "Flow run was cancelled": the loop grew it."""
    d = _alone_on_both()
    d.arrive(job("b", T0 + 2, 20 * 36, T0 + 2 + 44))
    now, actions = T0 + 2, d.step(T0 + 2)
    while "a" not in d.new(actions, Rescale) and now < T0 + 12:
        now += 2
        actions = d.step(now)
    d.ack("a", now, iteration=100)
    d.step(now)
    assert d.handle(Leaving("a"), now) == []
    d.handle(Ended("b"), now + 1)
    for later in (now + 2, now + 4, now + 6):
        assert not [a for a in d.step(later) if getattr(a, "run_id", None) == "a"]  # no grow: it is going
    (stop,) = d.handle(CancelRequested("a"), now + 50)  # Prefect did not stop it: the worker tells it to
    assert isinstance(stop, Stop)
    assert d.handle(Leaving("a"), now + 51) == [] and d.handle(CancelRequested("a"), now + 51) == []


def test_a_run_cancelled_while_no_worker_watched_is_adopted_only_to_be_stopped() -> None:
    d = Driver()
    (stop,) = d.handle(Adopted("a", job("a", T0, 4000, T0 + 600), share=2, running=True, held=(0, 1),
                               commanded=(0, 1), last_seq=3, cancelled=True), T0)
    assert isinstance(stop, Stop) and stop.seq == 4 and d.loop.gpu_map() == {0: "a", 1: "a"}
    d.arrive(job("b", T0, 4000, None))
    assert d.kinds(T0) == {"b": ["Admitted", "Await"]}  # "a" is not planned, and holds both


def test_a_best_effort_run_waits_while_no_gpu_is_spare() -> None:
    d = Driver()
    d.arrive(job("a", T0, 3000, T0 + 100))  # needs both GPUs from now on
    d.arrive(job("be", T0, 100, None))
    assert d.kinds(T0) == {"a": ["Admitted", "Launch"], "be": ["Admitted", "Await"]}
    d.handle(Ended("a"), T0 + 1)
    assert "be" in d.new(d.step(T0 + 2), Launch)


def test_a_run_adopted_after_a_restart_keeps_its_gpus_until_it_gives_them_up() -> None:
    d = Driver()
    d.handle(Adopted("a", job("a", T0 - 100, 4000, T0 + 600), share=2, running=True, held=(0, 1),
                     commanded=(0, 1), last_seq=1), T0)
    d.report("a", T0, 1000, (0, 1))
    d.arrive(job("b", T0, 20 * 36, T0 + 44))
    now = T0
    while now < T0 + 12:
        assert "b" not in d.new(d.step(now), Launch)  # a has not acknowledged any shrink yet
        now += 2
    assert d.loop.view("a", now).iteration == 1000  # type: ignore[union-attr]
    d.ack("a", now, iteration=1100)
    launch = d.new(d.step(now), Launch)["b"]
    assert set(launch.gpus).isdisjoint(d.commands["a"].gpus)


def test_an_adopted_run_the_policy_no_longer_guarantees_carries_on_best_effort() -> None:
    d = Driver()
    d.handle(Adopted("late", job("late", T0 - 100, 10**6, T0 + 10), share=1, running=True, held=(0,),
                     commanded=(0,), last_seq=1), T0)
    actions = d.step(T0)
    assert [type(a).__name__ for a in actions][:2] == ["GuaranteeLost", "Admitted"]  # never reported as rejected
    admitted = d.new(actions, Admitted)["late"]
    assert not admitted.guaranteed and d.loop.view("late", T0).plan_deadline is None  # type: ignore[union-attr]


def test_a_run_adopted_after_a_restart_stays_on_the_gpus_it_holds() -> None:
    # Found training on GPUs 2,3 by a freshly started service; alone, a fresh
    # placement would put a 2-GPU job on 0,1 and move it (a restart for nothing).
    d = Driver(gpus=4)
    d.handle(Adopted("a", job("a", T0, 4000, T0 + 600), share=2, running=True, held=(2, 3), commanded=(2, 3),
                     last_seq=1), T0)
    assert d.kinds(T0) == {"a": ["Admitted"]}  # admitted again, nothing to tell it
    assert d.loop.runs["a"].target == (2, 3) and d.loop.gpu_map() == {2: "a", 3: "a"}


def test_gpus_reserved_for_profiling_are_not_handed_out_until_given_back() -> None:
    d = Driver()
    assert d.loop.free_block(largest=4) == (0, 1)
    d.handle(Reserved("profiling mlp@32", (0, 1)), T0)
    assert d.loop.free_block(largest=4) == ()
    d.arrive(job("a", T0, 4000, T0 + 600))
    assert d.kinds(T0)["a"] == ["Admitted", "Await"]  # placed, but its GPUs are the profiler's
    assert d.loop.gpu_map() == {0: "service:profiling mlp@32", 1: "service:profiling mlp@32"}
    d.handle(Unreserved("profiling mlp@32"), T0 + 1)
    assert d.new(d.step(T0 + 1), Launch)["a"].gpus == (0, 1)
    assert d.loop.free_block(largest=4) == ()  # now a's


def test_the_free_block_for_profiling_is_aligned_and_skips_gpus_runs_hold() -> None:
    d = Driver(gpus=8)
    d.handle(Adopted("x", job("x", T0, 10**6, None), share=None, running=True, held=(2,), commanded=(2,)), T0)
    d.step(T0)
    assert d.loop.free_block(largest=4) == (4, 5, 6, 7)
    d.handle(Reserved("p", (4, 5, 6, 7)), T0)
    assert d.loop.free_block(largest=4) == (0, 1)


def test_a_waiting_run_admitted_before_a_restart_is_launched_not_decided_again() -> None:
    d = Driver()
    # Admitted by the service's previous life with more room than it would get
    # now (its deadline is too close for a fresh admission): it keeps its place.
    d.handle(Adopted("w", job("w", T0 - 100, 36 * 600, T0 + 30), share=2, running=False), T0)
    assert d.kinds(T0) == {"w": ["GuaranteeLost"]}  # never a rejection
    assert "w" in d.new(d.step(T0 + 2), Launch)  # the next slot, best-effort


def test_an_arrival_mid_slot_is_decided_at_once_without_being_credited_the_slot_gone() -> None:
    d = _alone_on_both()
    assert d.step(T0 + 1.5) == []  # nothing new: the next plan is at the boundary
    calls = []
    schedule = d.loop.policy.schedule
    d.loop.policy.schedule = lambda request: calls.append(request) or schedule(request)  # type: ignore[method-assign]
    d.arrive(job("b", T0 + 1.5, 200, T0 + 120))
    assert "b" in d.new(d.step(T0 + 1.5), Admitted)  # same slot, but someone is waiting for an answer
    b = d.loop.view("b", T0 + 1.5)
    assert b is not None and b.deadline == T0 + 120 and b.plan_deadline == T0 + 120 - 2.0  # the margin's floor
    # Planned from the boundary at T0: b cannot use the 1.5 s already gone, a
    # loss of at most 1.5 s at its widest (36 it/s), which it is asked for on top.
    (request,) = calls
    assert request.status["b"].remaining == 200 + 36.0 * 1.5
    # a has run on both GPUs since the boundary: the plan gets back the work it credits again.
    assert request.status["a"].remaining == 4000 + 36.0 * 1.5


def test_plans_use_the_speed_a_run_shows_when_it_is_slower_than_its_profile() -> None:
    d = _alone_on_both()
    d.report("a", T0 + 1, 100, (0, 1), rate=18.0)  # profile: 36 it/s
    for slot in range(1, 11):
        d.step(T0 + 2 * slot)
    a = d.loop.runs["a"]
    assert 0.5 <= a.speed_ratio < 0.6 and abs(a.job.curve.speed(2) - 36.0 * a.speed_ratio) < 1e-9
    assert abs(a.job.curve.speed(1) - 20.0 * a.speed_ratio) < 1e-9  # the whole curve, not one point
    d.report("a", T0 + 21, 200, (0, 1), rate=50.0)  # faster than its profile: capped
    for slot in range(11, 41):
        d.step(T0 + 2 * slot)
    assert a.speed_ratio <= 1.0 and a.job.curve.speed(2) <= 36.0


def test_a_run_a_little_slower_than_its_profile_is_planned_at_its_speed_not_short_of_it() -> None:
    """dev102 under noise: a run at 0.84 of its profile was planned at 0.92
    all its life (the plan's ratio moved 30% of the way each slot, and only
    by 3% or more, so it froze 10% short), fell behind and missed."""
    d = _alone_on_both()
    for slot in range(1, 21):
        d.report("a", T0 + 2 * slot - 1, 100 * slot, (0, 1), rate=36.0 * 0.84)
        d.step(T0 + 2 * slot)
    a = d.loop.runs["a"]
    assert abs(a.speed_ratio - 0.84) <= 0.03 * 0.84, a.speed_ratio


def test_a_run_about_to_finish_is_not_resized() -> None:
    d = _alone_on_both()
    d.report("a", T0, 4000 - 10, (0, 1))  # 10 iterations at 36 it/s: less than a restart
    d.loop.runs["a"].retarget((0,))
    assert "a" not in d.kinds(T0 + 1)
    d.report("a", T0 + 1, 100, (0, 1))  # far from done: the resize goes ahead
    assert d.new(d.step(T0 + 1), Rescale)["a"].gpus == (0,)


def test_a_run_is_not_grown_when_the_restart_costs_more_than_the_growth_saves() -> None:
    d = Driver()
    d.arrive(job("a", T0, 4000, T0 + 600))
    d.arrive(job("b", T0, 4000, T0 + 600))  # one GPU each
    d.step(T0)
    d.ack("a", T0)
    d.handle(Ended("b"), T0 + 1)
    d.report("a", T0 + 1, 4000 - 30, d.commands["a"].gpus)  # 1.5 s left at one GPU: growing saves 0.67 s < 1 s
    assert "a" not in d.new(d.step(T0 + 2), Rescale)
    assert d.loop.runs["a"].target == (0, 1)
    d.report("a", T0 + 2, 4000 - 60, d.commands["a"].gpus)  # 3 s left: saves 1.33 s > 1 s
    assert d.new(d.step(T0 + 2), Rescale)["a"].gpus == (0, 1)


def _two_runs_one_wanting_the_others_gpu(mine_s: float, theirs_s: float) -> Driver:
    """"x" (due in `mine_s`) on one GPU, "y" (due in `theirs_s`) on the other;
    then the policy wants y on both and x nowhere."""
    d = Driver()
    d.arrive(job("x", T0, 20 * 40, T0 + mine_s))
    d.arrive(job("y", T0, 20 * 40, T0 + theirs_s))
    d.step(T0)
    for run_id in ("x", "y"):
        d.ack(run_id, T0)
    x, y = d.loop.runs["x"], d.loop.runs["y"]
    y.retarget(tuple(sorted(x.commanded + y.commanded)))
    x.retarget(())
    return d


def test_a_run_the_plan_parks_is_parked_even_for_a_run_due_later() -> None:
    """The plans guarantee both runs: the one due later gets the GPU its plan
    gives it now, or it is the one that misses (a rule that let the sooner run
    keep its GPU made an admitted run of dev102 miss by 190 s in the simulator)."""
    for theirs_s in (3600, 90):
        d = _two_runs_one_wanting_the_others_gpu(mine_s=100, theirs_s=theirs_s)
        assert "x" in d.new(d.step(T0 + 1), Park)


def test_a_run_whose_checkpoint_saves_fail_is_not_moved_until_one_works() -> None:
    """A resize needs a save: told to move while its saves fail, a run would
    refuse (flows/training/rank/saving.py) and its new GPUs would sit claimed. The
    loop leaves it where it is, and moves it once it reports a good save."""
    d = _alone_on_both()
    d.report("a", T0 + 1, 30, (0, 1), 36.0)
    d.handle(Progress("a", 40, (0, 1), 36.0, None, "checkpoint save to /ck/a failed (1 in a row): OSError"), T0 + 1.5)
    d.arrive(job("b", T0 + 2, 20 * 36, T0 + 2 + 44))
    now = T0 + 2
    for _ in range(5):
        assert "a" not in d.new(d.step(now), Rescale)
        now += 2
    d.report("a", now, 400, (0, 1), 36.0)  # a save worked: nothing said of one any more
    assert len(d.new(d.step(now), Rescale)["a"].gpus) == 1


def test_a_short_run_planned_late_in_its_window_starts_at_once_on_an_idle_cluster() -> None:
    """The test stack's shape (2 s slots, 2.5 s charged per start) and a model
    profiled at ~1,000 it/s: 60 iterations due in 10 minutes are planned in the
    window's last slots, and spare GPUs must not wait for that. A grant to a run
    its plan gives nothing now cannot hurt it: taken back, it is where it was.
    Before, the grant asked for two restarts of slack and the run sat idle for
    the whole window (a CI run of the service tests timed out on it)."""
    from scheduler_service.loop import LoopSettings
    from scheduler_service.loop.actions import Launch
    from scheduler_service.policy import ThroughputCurve
    from scheduler_service.policy.overhead import RestartOverhead

    settings = LoopSettings(policy="elasticflow-overload", interval_s=2.0, overhead=RestartOverhead(0.5, 0.5, 0.0),
                            poll_s=1.0, launch_s=0.0, safety_margin=0.05)
    for decided_at in (T0 + 5.0, T0 + 6.9):  # early and late in a slot: the plan's slots round differently
        d = Driver(settings=settings)
        d.arrive(job("a", decided_at, 60, T0 + 600, ThroughputCurve({1: 985.7})), now=T0)
        actions = d.step(decided_at)
        assert d.new(actions, Launch), (decided_at, actions)
        assert d.loop.policy.plans["a"].runs[0].start * 2.0 > T0 + 500  # it was planned late


def test_an_adopted_run_that_loses_its_guarantee_keeps_its_gpus_until_it_gives_them_up() -> None:
    """Found by bench/chaos.py: the worker was killed just after launching a
    run; the next one adopted it, and its plan could no longer guarantee it.
    Sent back to wait for the next plan as best-effort, it held no GPUs in the
    loop for that step, and an urgent arrival was launched onto its GPUs while
    it trained there."""
    d = Driver()
    d.handle(Adopted("a", job("a", T0 - 10, 30_000, T0 + 40), share=1, running=True, held=(0, 1),
                     commanded=(0, 1), pending_seq=1, last_seq=1), T0)
    d.arrive(job("b", T0, 20 * 10, T0 + 160))
    assert "b" not in d.new(d.step(T0), Launch)  # a trains on both GPUs, its launch not even acknowledged
    d.handle(Acknowledged("a", 1, (0, 1)), T0 + 1)
    now = T0 + 2
    while "b" not in d.new(actions := d.step(now), Launch):
        assert now < T0 + 30, "b never launched"
        if "a" in d.commands:
            d.ack("a", now)  # told to give way: it does
        now += 2
    held_by_a = {g for g, holder in d.loop.gpu_map().items() if holder == "a"}
    assert held_by_a.isdisjoint(d.new(actions, Launch)["b"].gpus)


def test_an_adopted_run_that_ends_before_it_is_planned_again_is_released() -> None:
    """Found by bench/chaos.py --ray: the worker was killed, the run it had
    launched finished while no worker watched, and the next worker heard of
    the end before its first plan; the loop dropped the run as 'never
    decided', so the store kept it running on its GPU forever."""
    from scheduler_service.loop.actions import GpusFreed

    d = Driver()
    d.handle(Adopted("a", job("a", T0 - 100, 4000, T0 + 600), share=1, running=True, held=(0,),
                     commanded=(0,), last_seq=1), T0)
    actions = d.handle(Ended("a"), T0 + 1)
    assert [(a.run_id, a.launched) for a in actions if isinstance(a, GpusFreed)] == [("a", True)]
    assert d.loop.gpu_map() == {} and d.loop.view("a", T0 + 1) is None


def test_a_run_that_reported_its_last_iteration_is_neither_parked_nor_told_its_guarantee_is_lost() -> None:
    """Between its last iteration and its process's end, a run needs no GPU
    time: the plan gives its GPUs to another, but it keeps them until it ends
    (a park would checkpoint a finished run and tell its user "parked"), and
    a start it will never make is no reason to say its deadline is lost (a
    run that met its deadline with 8 s to spare was told so 2 s before)."""
    from scheduler_service.loop.actions import GuaranteeLost
    from scheduler_service.loop import LoopSettings
    from tests.loop.driver import SETTINGS

    d = Driver(settings=LoopSettings(**{**SETTINGS.model_dump(), "defend": True}))
    d.arrive(job("a", T0, 100_000, T0 + 100_000))
    d.step(T0)
    d.ack("a", T0)
    d.arrive(job("b", T0 + 2, 20 * 10, T0 + 2 + 20))  # 10 s on one GPU: it starts now, a shrinks
    now = T0 + 2
    while "b" not in d.new(d.step(now), Launch) and now < T0 + 12:
        if "a" in d.commands and len(d.commands["a"].gpus) == 1:
            d.ack("a", now, iteration=50)
        now += 0.5
    d.ack("b", now)
    d.report("b", now + 1, 100, d.commands["b"].gpus, rate=20.0)
    end = T0 + 2 + 20 - 0.5  # all its iterations reported, its process not ended yet, its deadline near
    d.report("b", end, 200, d.commands["b"].gpus, rate=20.0)
    actions = [a for t in (end, end + 0.2, end + 0.4) for a in d.step(t)]
    assert not [a for a in actions if a.run_id == "b" and isinstance(a, (Park, Rescale, GuaranteeLost))], actions
    d.handle(Ended("b"), end + 0.5)
    assert "a" in d.new(d.step(T0 + 24), Rescale)  # its GPU goes to a once it ended


def test_the_architecture_page_names_every_event_and_action_of_the_loop() -> None:
    """Issue 42: docs/architecture.md lists every event and action, checked
    against the code (the page once lacked `Started` and `StartsRecalled`)."""
    import typing
    from pathlib import Path

    from scheduler_service.loop import actions, events

    page = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()
    names = [t.__name__ for t in (*typing.get_args(actions.Action), *typing.get_args(events.Event))]
    assert len(names) > 20
    assert not [name for name in names if f"`{name}" not in page]
