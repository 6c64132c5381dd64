"""The loop under a cluster that does not train at the profiles' speed: a
run that falls behind is re-planned at the speed it shows (and given GPUs
from runs with slack), a run that can no longer make it is told at once,
and admission keeps a margin learnt from the speed errors seen."""

from __future__ import annotations

from scheduler_service.loop.actions import GuaranteeLost
from scheduler_service.loop.speeds import MarginRule, SpeedErrors
from scheduler_service.policy import ThroughputCurve
from tests.loop.driver import SETTINGS, T0, Cluster, Driver, job

CURVE = ThroughputCurve({1: 10.0, 2: 19.0, 4: 36.0})


def test_a_run_slower_than_its_profile_gets_gpus_from_a_run_with_slack_and_meets_its_deadline() -> None:
    """`urgent` is admitted on 2 of 4 GPUs (45 s of work there at its
    profile, a 60 s window) but trains at 0.6 of its profile: on 2 GPUs it
    would take 75 s. `long` has hours to spare. Planned at the speed it
    shows, `urgent` is given all 4 GPUs and meets its deadline; planned at
    its profile (the loop before), it was re-planned short every slot and
    finished late."""
    d = Driver(gpus=4)
    jobs = {"long": job("long", T0, 36 * 400, T0 + 5000, CURVE),
            "urgent": job("urgent", T0 + 10, 19 * 45, T0 + 10 + 60, CURVE)}
    d.arrive(jobs["long"])
    cluster = Cluster(d, {"urgent": 0.6})
    cluster.play(jobs, T0, T0 + 10)
    d.arrive(jobs["urgent"])
    cluster.play(jobs, T0 + 10, T0 + 1000)
    assert max(cluster.widths["urgent"]) == 4
    assert cluster.finished["urgent"] <= jobs["urgent"].deadline  # type: ignore[operator]
    assert cluster.finished["long"] <= jobs["long"].deadline  # type: ignore[operator]


def test_a_run_that_can_no_longer_make_it_is_told_at_once_with_its_projected_finish() -> None:
    """At 0.4 of its profile, 50 s of work on both GPUs takes 125 s: its
    60 s window cannot hold it whatever it is given. It hears so within
    seconds of showing that speed, not when its deadline passes."""
    d = Driver(gpus=2)
    doomed = job("doomed", T0, 36 * 50, T0 + 60)
    d.arrive(doomed)
    Cluster(d, {"doomed": 0.4}).play({"doomed": doomed}, T0, T0 + 20)
    lost = [a for a in d.log if isinstance(a, GuaranteeLost)]
    assert len(lost) == 1 and lost[0].run_id == "doomed"
    assert lost[0].projected_finish is not None and lost[0].projected_finish > doomed.deadline  # type: ignore[operator]


def test_a_run_on_its_profile_is_never_told_it_lost_its_guarantee() -> None:
    d = Driver(gpus=2)
    ok = job("ok", T0, 36 * 50, T0 + 60)
    d.arrive(ok)
    cluster = Cluster(d, {})
    cluster.play({"ok": ok}, T0, T0 + 100)
    assert cluster.finished["ok"] <= ok.deadline  # type: ignore[operator]
    assert not [a for a in d.log if isinstance(a, GuaranteeLost)]


def test_the_learnt_margin_grows_with_the_speed_errors_seen() -> None:
    rule = MarginRule(quantile=0.2, at_most=0.3, min_runs=5)
    errors = SpeedErrors(rule, default=0.05)
    assert errors.margin("resnet", "A100") == 0.05  # nothing seen: the default
    for i in range(10):
        errors.seen("resnet", "A100", f"r{i}", 1.0)
    assert errors.margin("resnet", "A100") == 0.0  # every run on its profile: none beyond the floor
    margins = []
    for spread in (0.05, 0.15, 0.25):
        for i in range(10):
            errors.seen("resnet", "A100", f"r{i}", 1.0 - spread * (i % 2))  # half of them `spread` slower
        margins.append(errors.margin("resnet", "A100"))
    assert margins[0] < margins[1] < margins[2] <= 0.3
    for i in range(10):
        errors.seen("resnet", "A100", f"r{i}", 0.2)
    assert errors.margin("resnet", "A100") == 0.3  # bounded
    assert errors.margin("bert", "A100") == 0.3  # a model not seen yet: every model's on the kind
    assert errors.margin("bert", "T4") == 0.3  # and on a kind not seen: every one's


def test_a_run_admitted_after_slow_runs_keeps_a_wider_margin_than_one_after_runs_on_their_profile() -> None:
    plan_deadlines = []
    for factor in (1.0, 0.7):
        d = Driver(gpus=8, nodes=1)
        jobs = {f"r{i}": job(f"r{i}", T0, 36 * 40, T0 + 500, CURVE) for i in range(6)}
        for j in jobs.values():
            d.arrive(j)
        Cluster(d, {r: factor for r in jobs}).play(jobs, T0, T0 + 20)
        d.arrive(job("new", T0 + 20, 36 * 10, T0 + 20 + 1000, CURVE))
        d.step(T0 + 20)
        plan_deadlines.append(d.loop.runs["new"].plan_deadline)
    assert plan_deadlines[1] < plan_deadlines[0] - 200  # 0.7: about 30% of its 1000 s window kept
