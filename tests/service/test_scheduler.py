"""The service's GPU bookkeeping, without Prefect: the policy's placement turns
into launches and control-channel commands, and a GPU changes holder only after
its old holder acknowledged giving it up."""

from __future__ import annotations

from pathlib import Path

from flows.training.control import ControlAck, FileControlChannel
from scheduler_service.policy import Job, ThroughputCurve, Topology
from scheduler_service.policy.elasticflow import ElasticFlowPolicy
from scheduler_service.policy.overhead import RestartOverhead
from scheduler_service.worker.run_state import RunState
from scheduler_service.worker.scheduler import Scheduler

T0 = 1000.0  # the policy takes seconds since the service started, not epoch seconds
CURVE = ThroughputCurve({1: 20.0, 2: 36.0})


def _scheduler() -> Scheduler:
    policy = ElasticFlowPolicy(Topology(1, 1, 2), interval=2.0, overhead=RestartOverhead(0.5, 0.5, 0.0))
    return Scheduler(policy)


def _run(tmp: Path, run_id: str, now: float, iterations: float, deadline: float | None) -> RunState:
    return RunState(run_id, Job(run_id, now, iterations, deadline, CURVE), FileControlChannel(run_id, tmp))


def _ack(run: RunState, iteration: int = 0) -> None:
    command = run.channel.latest()
    assert command is not None
    run.channel.acknowledge(ControlAck(seq=command.seq, iteration=iteration, gpus=command.gpus or []))


def _alone_on_both(tmp: Path) -> tuple[Scheduler, RunState]:
    """A scheduler whose one run, "a", trains on both GPUs."""
    sched = _scheduler()
    a = _run(tmp, "a", T0, 4000, T0 + 600)
    sched.arrive(a)
    sched.plan(T0)
    sched.actuate(T0)
    _ack(a)
    return sched, a


def test_admitted_run_launches_on_its_placement_and_gets_the_command(tmp_path: Path) -> None:
    sched = _scheduler()
    sched.arrive(_run(tmp_path, "a", T0, 4000, T0 + 600))
    result = sched.plan(T0)
    assert result is not None and result.decisions[0].admitted
    assert sched.plan(T0 + 0.5) is None  # at most once per slot
    (action,) = sched.actuate(T0)
    assert action.kind == "launch" and action.gpus == (0, 1)
    command = sched.runs["a"].channel.latest()
    assert command is not None and command.action == "rescale" and command.gpus == [0, 1]


def test_gpus_change_hands_only_after_the_old_holder_acknowledged(tmp_path: Path) -> None:
    sched, a = _alone_on_both(tmp_path)
    # b needs one GPU within a slot or two to make its deadline: a shrinks to one.
    b = _run(tmp_path, "b", T0 + 2, 20 * 36, T0 + 2 + 40)
    sched.arrive(b)
    result = sched.plan(T0 + 2)
    assert result is not None and result.decisions[0].admitted and result.decisions[0].share == 1
    now, actions = T0 + 2, {}
    while "a" not in actions and now < T0 + 12:
        actions = {x.run_id: x for x in sched.actuate(now)}
        now += 2
        sched.plan(now)
    assert actions["a"].kind == "rescale" and len(actions["a"].gpus) == 1
    assert actions["b"].kind == "await"  # a still holds both GPUs until it acknowledges
    assert {x.run_id: x.kind for x in sched.actuate(now)}["b"] == "await"
    _ack(a, iteration=100)
    actions = {x.run_id: x for x in sched.actuate(now)}
    assert actions["b"].kind == "launch"
    assert set(actions["b"].gpus).isdisjoint(sched.runs["a"].held)
    assert sched.gpu_map() == {0: "a", 1: "b"} or sched.gpu_map() == {0: "b", 1: "a"}
    sched.finish("b")
    sched.plan(now + 2)  # completion: a grows back
    assert sched.runs["a"].target == (0, 1)
    (action,) = sched.actuate(now + 2)
    assert action.kind == "rescale" and action.gpus == (0, 1)


def test_a_run_told_to_stop_holds_its_gpus_until_it_acknowledges_and_is_never_commanded_again(
        tmp_path: Path) -> None:
    sched, a = _alone_on_both(tmp_path)
    assert sched.stop("a") and sched.stop("a")  # once: a second call sends nothing more
    command = a.channel.latest()
    assert command is not None and command.action == "stop" and command.seq == 2
    b = _run(tmp_path, "b", T0 + 2, 36 * 60, T0 + 2 + 65)  # needs both GPUs: only if "a" no longer counts
    sched.arrive(b)
    result = sched.plan(T0 + 2)
    assert result is not None and result.decisions[0].admitted and "a" not in result.allocation
    assert sched.runs["b"].target == (0, 1) and sched.runs["a"].target == ()
    assert {x.run_id: x.kind for x in sched.actuate(T0 + 2)} == {"b": "await"}  # "a" still holds both
    assert a.channel.latest() == command  # no rescale or park supersedes the stop
    _ack(a, iteration=100)
    actions = {x.run_id: x for x in sched.actuate(T0 + 2)}
    assert actions["a"].kind == "released" and actions["b"].kind == "launch"
    sched.finish("a")
    sched.plan(T0 + 4)
    assert "a" not in sched.runs and not sched.stop("a")


def test_a_run_cancelled_while_no_worker_watched_is_adopted_only_to_be_stopped(tmp_path: Path) -> None:
    sched = _scheduler()
    a = _run(tmp_path, "a", T0, 4000, T0 + 600)
    a.held = a.commanded = (0, 1)
    sched.adopt(a, running=True, cancelled=True)
    command = a.channel.latest()
    assert command is not None and command.action == "stop" and sched.gpu_map() == {0: "a", 1: "a"}
    b = _run(tmp_path, "b", T0, 4000, None)
    sched.arrive(b)
    result = sched.plan(T0)
    assert result is not None and [d.job_id for d in result.decisions] == ["b"]  # "a" is not planned
    assert {x.run_id: x.kind for x in sched.actuate(T0)} == {"b": "await"}


def test_best_effort_run_waits_while_no_gpu_is_spare(tmp_path: Path) -> None:
    sched = _scheduler()
    sched.arrive(_run(tmp_path, "a", T0, 3000, T0 + 100))  # needs both GPUs from now on
    sched.arrive(_run(tmp_path, "be", T0, 100, None))
    result = sched.plan(T0)
    assert result is not None and all(d.admitted for d in result.decisions)
    kinds = {x.run_id: x.kind for x in sched.actuate(T0)}
    assert kinds == {"a": "launch", "be": "await"}
    sched.finish("a")
    sched.plan(T0 + 2)
    assert [x.kind for x in sched.actuate(T0 + 2)] == ["launch"]


def test_a_run_adopted_after_a_restart_keeps_its_gpus_until_it_gives_them_up(tmp_path: Path) -> None:
    sched = _scheduler()
    a = _run(tmp_path, "a", T0 - 100, 4000, T0 + 600)
    a.channel.request("rescale", [0, 1])  # what the previous service instance told it
    _ack(a, iteration=1000)
    a.channel.publish_status({"iteration": 1000})
    sched.adopt(RunState("a", a.job, a.channel, held=(0, 1), commanded=(0, 1)))
    b = _run(tmp_path, "b", T0, 20 * 36, T0 + 40)
    sched.arrive(b)
    result = sched.plan(T0)
    assert result is not None and [d.job_id for d in result.decisions if d.admitted] == ["a", "b"]
    assert sched.status(T0)["a"].remaining == 3000
    now, launched = T0, None
    while now < T0 + 12 and launched is None:
        actions = {x.run_id: x for x in sched.actuate(now)}
        launched = actions.get("b") if actions.get("b") and actions["b"].kind == "launch" else None
        assert launched is None  # a has not acknowledged any shrink yet
        now += 2
        sched.plan(now)
    _ack(a, iteration=1100)
    actions = {x.run_id: x for x in sched.actuate(now)}
    assert actions["b"].kind == "launch" and set(actions["b"].gpus).isdisjoint(sched.runs["a"].held)


def test_an_adopted_run_the_policy_no_longer_guarantees_carries_on_best_effort(tmp_path: Path) -> None:
    sched = _scheduler()
    late = _run(tmp_path, "late", T0 - 100, 10**6, T0 + 10)  # cannot make it any more
    late.channel.request("rescale", [0])
    _ack(late)
    sched.adopt(RunState("late", late.job, late.channel, held=(0,), commanded=(0,)))
    result = sched.plan(T0)
    assert result is not None and result.decisions == []  # never reported as rejected
    result = sched.plan(T0 + 2)
    assert result is not None and result.decisions[0].admitted and sched.runs["late"].job.deadline is None


def test_a_run_adopted_after_a_restart_stays_on_the_gpus_it_holds(tmp_path: Path) -> None:
    policy = ElasticFlowPolicy(Topology(1, 1, 4), interval=2.0, overhead=RestartOverhead(0.5, 0.5, 0.0))
    sched = Scheduler(policy)
    # Found training on GPUs 2,3 by a freshly started service; alone, a fresh
    # placement would put a 2-GPU job on 0,1 and move it (a restart for nothing).
    curve = ThroughputCurve({1: 20.0, 2: 36.0})
    adopted = RunState("a", Job("a", T0, 4000, T0 + 600, curve), FileControlChannel("a", tmp_path),
                  held=(2, 3), commanded=(2, 3))
    sched.adopt(adopted)
    result = sched.plan(T0)
    assert result is not None and result.allocation["a"] == 2
    assert sched.runs["a"].target == (2, 3)
    assert [a for a in sched.actuate(T0) if a.run_id == "a"] == []  # nothing to tell it


def test_gpus_reserved_for_profiling_are_not_handed_out_until_given_back(tmp_path: Path) -> None:
    sched = _scheduler()
    assert sched.free_block(2, largest=4) == (0, 1)
    sched.reserved["profiling mlp@32"] = (0, 1)
    assert sched.free_block(2, largest=4) == ()
    sched.arrive(_run(tmp_path, "a", T0, 4000, T0 + 600))
    result = sched.plan(T0)
    assert result is not None and result.decisions[0].admitted
    (action,) = sched.actuate(T0)
    assert action.kind == "await"  # placed, but its GPUs are the profiler's
    assert sched.gpu_map() == {0: "service:profiling mlp@32", 1: "service:profiling mlp@32"}
    del sched.reserved["profiling mlp@32"]
    (action,) = sched.actuate(T0 + 1)
    assert action.kind == "launch" and action.gpus == (0, 1)
    assert sched.free_block(2, largest=4) == ()  # now a's


def test_the_free_block_for_profiling_is_aligned_and_skips_gpus_runs_hold(tmp_path: Path) -> None:
    policy = ElasticFlowPolicy(Topology(1, 1, 8), interval=2.0, overhead=RestartOverhead(0.5, 0.5, 0.0))
    sched = Scheduler(policy)
    busy = RunState("x", Job("x", T0, 10, None, CURVE), FileControlChannel("x", tmp_path), phase="running", held=(2,))
    sched.runs["x"] = busy
    assert sched.free_block(8, largest=4) == (4, 5, 6, 7)
    sched.reserved["p"] = (4, 5, 6, 7)
    assert sched.free_block(8, largest=4) == (0, 1)


def test_a_waiting_run_admitted_before_a_restart_is_launched_not_decided_again(tmp_path: Path) -> None:
    sched = _scheduler()
    # Admitted by the service's previous life with more room than it would get
    # now (its deadline is too close for a fresh admission): it keeps its place.
    waiting = RunState("w", Job("w", T0 - 100, 36 * 600, T0 + 30, CURVE), FileControlChannel("w", tmp_path), share=2)
    sched.adopt(waiting, running=False)
    for now in (T0, T0 + 2):  # the policy cannot promise it now: next slot it goes on best-effort
        result = sched.plan(now)
        assert result is not None and all(d.admitted for d in result.decisions)  # never a rejection now
    (action,) = sched.actuate(T0 + 2)
    assert action.kind == "launch" and action.run_id == "w"
    assert sched.runs["w"].job.deadline is None


def test_an_arrival_mid_slot_is_decided_at_once_without_being_credited_the_slot_gone(tmp_path: Path) -> None:
    sched, a = _alone_on_both(tmp_path)
    assert sched.plan(T0 + 1.5) is None  # nothing new: the next plan is at the boundary
    b = _run(tmp_path, "b", T0 + 1.5, 200, T0 + 120)
    sched.arrive(b)
    result = sched.plan(T0 + 1.5)  # same slot, but someone is waiting for an answer
    assert result is not None and [d.job_id for d in result.decisions] == ["b"]
    # Planned from the boundary at T0: the 1.5 s already gone are not b's to use.
    assert result.arrivals["b"].job.deadline == T0 + 120 - 1.5
    assert result.arrivals["b"].deadline == T0 + 120  # what its user is told stays theirs
    # a has run at 2 GPUs since the boundary: the plan gets back the work it credits again.
    status = sched.status(T0 + 1.5)
    assert status["a"].remaining == 4000 + 36.0 * 1.5


def test_plans_use_the_speed_a_run_shows_when_it_is_slower_than_its_profile(tmp_path: Path) -> None:
    sched, a = _alone_on_both(tmp_path)
    a.channel.publish_status({"iteration": 100, "iterations_per_s": 18.0, "gpus": [0, 1]})  # profile: 36 it/s
    for _ in range(10):
        sched.status(T0 + 5)
    assert 0.5 <= a.speed_ratio < 0.6 and abs(a.job.curve.speed(2) - 36.0 * a.speed_ratio) < 1e-9
    assert abs(a.job.curve.speed(1) - 20.0 * a.speed_ratio) < 1e-9  # the whole curve, not one point
    a.channel.publish_status({"iteration": 200, "iterations_per_s": 50.0, "gpus": [0, 1]})  # faster: capped
    for _ in range(30):
        sched.status(T0 + 10)
    assert a.speed_ratio <= 1.0 and a.job.curve.speed(2) <= 36.0


def test_a_run_about_to_finish_is_not_resized(tmp_path: Path) -> None:
    sched, a = _alone_on_both(tmp_path)
    a.channel.publish_status({"iteration": 4000 - 10, "gpus": [0, 1]})  # 10 iterations at 36 it/s: < a restart
    a.target = (0,)
    assert [x for x in sched.actuate(T0 + 1) if x.run_id == "a"] == []
    a.channel.publish_status({"iteration": 100, "gpus": [0, 1]})  # far from done: the resize goes ahead
    (action,) = [x for x in sched.actuate(T0 + 1) if x.run_id == "a"]
    assert action.kind == "rescale" and action.gpus == (0,)


def test_a_run_is_not_grown_when_the_restart_costs_more_than_the_growth_saves(tmp_path: Path) -> None:
    sched, a = _alone_on_both(tmp_path)  # the policy's restart: 1 s
    a.commanded = a.held = (0,)
    a.target = (0, 1)  # 20 -> 36 it/s: growing saves 44% of what is left
    a.channel.publish_status({"iteration": 4000 - 30, "gpus": [0]})  # 1.5 s left at one GPU: saves 0.67 s < 1 s
    assert [x for x in sched.actuate(T0 + 1) if x.run_id == "a"] == []
    a.channel.publish_status({"iteration": 4000 - 60, "gpus": [0]})  # 3 s left: saves 1.33 s > 1 s
    (action,) = [x for x in sched.actuate(T0 + 1) if x.run_id == "a"]
    assert action.kind == "rescale" and action.gpus == (0, 1)


def test_a_deadline_run_is_not_parked_for_a_run_due_later(tmp_path: Path) -> None:
    sched = _scheduler()
    urgent = _run(tmp_path, "urgent", T0, 4000, T0 + 100)
    urgent.phase, urgent.commanded, urgent.held, urgent.target = "running", (0,), (0,), ()
    patient = _run(tmp_path, "patient", T0, 4000, T0 + 3600)
    patient.phase, patient.commanded, patient.held, patient.target = "running", (1,), (1,), (0, 1)
    sched.runs = {"urgent": urgent, "patient": patient}
    kinds = {x.run_id: x.kind for x in sched.actuate(T0 + 1)}
    assert "urgent" not in kinds  # it keeps GPU 0; the run due an hour later waits for it
    patient.deadline = T0 + 50  # due sooner than the urgent one: then it may take GPU 0
    assert {x.run_id: x.kind for x in sched.actuate(T0 + 2)}.get("urgent") == "park"
