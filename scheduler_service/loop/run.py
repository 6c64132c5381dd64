"""One run as the control loop schedules it: its policy job, its two
deadlines, who physically holds which of its GPUs, and what it last
reported. Everything a person sees of a run but scheduling does not need
(its name, Prefect objects, history rows) lives with the driver.

The loop is the only caller of these methods; each one is one transition of
the run's life, so the rules that move a run are readable here in one place.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace

from scheduler_service.contracts import RunPhase
from scheduler_service.loop.deadlines import NO_MARGIN, SafetyMargin, plan_deadline_for, user_deadline_for
from scheduler_service.policy import Job, JobStatus
from scheduler_service.policy.overhead import keeps_gpus

# A run's own rate, as the loop projects with it: iterations over the last
# RATE_WINDOW_S of its reports (at least RATE_MIN_SPAN_S of them), not the
# flow's 20-iteration window, which swings by hours right after a resize.
RATE_WINDOW_S = 120.0
RATE_MIN_SPAN_S = 30.0
NOT_MOVING_S = RATE_WINDOW_S * 100  # projected finish of a run that does not move (parked): far away


@dataclass(frozen=True, slots=True)
class RunFacts:
    """A run as displays read it: the cluster view, `status`, the history artifact."""

    run_id: str
    phase: RunPhase
    model: str
    held: tuple[int, ...]
    iteration: int
    iterations: float
    deadline: float | None  # the user's
    plan_deadline: float | None
    share: int | None
    projected_finish: float | None
    risk_margin_s: float
    at_risk: bool = False  # the loop's one rule (ControlLoop._risk_changes), which every display reads


class Rate:
    """(time, iteration) samples of one run, to project its finish from a rate
    measured over minutes rather than over its last few iterations."""

    def __init__(self) -> None:
        self.samples: deque[tuple[float, int]] = deque()

    def projected(self, now: float, iteration: int, total: float) -> float | None:
        if not self.samples or iteration != self.samples[-1][1] or now - self.samples[-1][0] >= RATE_WINDOW_S / 4:
            self.samples.append((now, iteration))
        while len(self.samples) > 2 and now - self.samples[1][0] >= RATE_WINDOW_S:
            self.samples.popleft()
        (t0, i0), i1 = self.samples[0], self.samples[-1][1]
        if now - t0 < RATE_MIN_SPAN_S or i1 < i0:
            return None  # too little seen (or a restart from a checkpoint): another projection stands
        if i1 == i0:
            return now + NOT_MOVING_S  # not moving: it will not make it as things stand
        return now + (total - iteration) * (now - t0) / (i1 - i0)


class LoopRun:
    """One run from its arrival at the loop to its end."""

    def __init__(self, run_id: str, job: Job, taken_in_at: float, reserve_s: float = 0.0,
                 margin: SafetyMargin = NO_MARGIN, measured_up_to: int | None = None,
                 profiled_as: Job | None = None) -> None:
        self.run_id = run_id
        self.measured_up_to = measured_up_to  # its curve is partial: measured on at most this many GPUs
        self.deadline = job.deadline  # the user's
        self.taken_in_at = taken_in_at
        self.reserve_s = reserve_s  # kept in front of it: a new run's start beyond the restart the plans charge
        self.margin = margin
        self.job = job  # the policy's view; job.deadline is the plan deadline
        self.profiled_as = profiled_as or job  # as it arrived: its curve as profiled, before any speed seen
        self.phase = RunPhase.ARRIVED
        self.held: tuple[int, ...] = ()  # GPUs it may be using right now
        self.target: tuple[int, ...] = ()  # where the policy wants it
        self.commanded: tuple[int, ...] = ()  # the last GPU set it was told to use
        self.pending_seq: int | None = None  # a command not yet acknowledged
        self.seq = 0  # the newest command on its channel
        self.since = 0.0  # last (re)start: the restart overhead is paid from here
        self.share: int | None = None
        self.adopted = False  # admitted by an earlier life of the service: never rejected now
        self.stopping = False  # cancelled: planned and commanded no more, it holds its GPUs until it ends
        self.told_to_stop = False  # and sent a stop on its channel (nothing of Prefect's stops it)
        self.speed_ratio = 1.0  # its measured speed over its profile's, as the plans use it
        self.measured_ratio: float | None = None  # the same, smoothed, faster or slower: its speed error
        self.guarantee_lost = False  # told it can no longer make its deadline
        self.planned_finish: float | None = None  # the policy's projection
        self.iteration = 0  # what it last reported
        self.reported_gpus: tuple[int, ...] = ()
        self.reported_rate: float | None = None
        self.own_projection: float | None = None  # the flow's own, until the loop has seen enough
        self.save_error: str | None = None  # while its checkpoint saves fail (flows/training/rank/saving.py)
        self.launched_at: float | None = None  # until its first iteration: what a start really costs
        self.launched_from = 0  # the iteration of its last command (a launch or a resize)
        self.in_place = False  # its last change kept some of its GPUs: a resize in place, not a restart
        self.resized_at: float | None = None  # until its first iteration on the new set: what a resize costs
        self.at_risk = False
        self.risk_turning_since: float | None = None  # since when its outlook has pointed the other way
        self.news = False  # it reported since its outlook was last assessed
        self.rate = Rate()
        self.replan()

    @property
    def finishing(self) -> bool:
        """It reported its last iteration and its process has not ended yet:
        it needs no more GPU time, and nothing it is told now changes when it ends."""
        return self.phase == RunPhase.RUNNING and self.iteration >= self.job.iterations

    # -- deadlines -------------------------------------------------------------
    @property
    def plan_deadline(self) -> float | None:
        return self.job.deadline

    def plan_with(self, plan_deadline: float | None) -> None:
        self.job = replace(self.job, deadline=plan_deadline)

    def replan(self) -> None:
        """The plan deadline from the user's, after `reserve_s` or `margin` changed."""
        self.plan_with(plan_deadline_for(self.deadline, self.taken_in_at, self.reserve_s, self.margin))

    def demote(self) -> None:
        """No longer guaranteed: planned best-effort from here on, never rejected."""
        self.share = None
        self.plan_with(None)

    def to_user_time(self, plan_time: float) -> float:
        """A time on the plan's deadline scale (an earliest feasible deadline) as the user's."""
        if self.deadline is None or self.plan_deadline is None:
            return plan_time
        return user_deadline_for(plan_time, self.taken_in_at, self.reserve_s, self.margin)

    def risk_margin(self, at_most_s: float, floor_s: float) -> float:
        """How close its projected finish may come to its deadline before it
        is at risk: `at_most_s`, but no more than half the room its plan keeps
        in front of the deadline (start cost and safety margin), at least
        `floor_s` (a slot). A short run's plan ends within a minute of its
        deadline by design; it is at risk once it has lost half of that room,
        not from the start. A plan that keeps no room leaves `at_most_s`."""
        if self.deadline is None or self.plan_deadline is None or self.deadline <= self.plan_deadline:
            return at_most_s
        return max(floor_s, min(at_most_s, (self.deadline - self.plan_deadline) / 2))

    # -- decisions -------------------------------------------------------------
    def admit(self, share: int | None) -> None:
        self.share = share
        if self.phase == RunPhase.ARRIVED:
            self.phase = RunPhase.ADMITTED

    def adopt(self, running: bool, held: tuple[int, ...], commanded: tuple[int, ...], pending_seq: int | None,
              last_seq: int, share: int | None, since: float) -> None:
        """As an earlier life of the service left it."""
        self.adopted = True
        self.phase = RunPhase.RUNNING if running else RunPhase.ADMITTED
        self.held, self.commanded = (held, commanded) if running else ((), ())
        self.pending_seq = pending_seq if running else None
        self.seq, self.share, self.since = last_seq, share, since

    def retarget(self, gpus: tuple[int, ...]) -> None:
        self.target = gpus

    # -- commands and what comes back -----------------------------------------
    def command(self, gpus: tuple[int, ...], now: float) -> int:
        """Told to move to `gpus` (none: park); the seq of the command. A start
        not seen through to its first iteration is no measure of what a start
        costs: a run parked before it trained would count its wait."""
        self.seq += 1
        self.in_place = keeps_gpus(self.commanded, gpus)
        self.pending_seq, self.commanded, self.since = self.seq, gpus, now
        self.launched_at = None
        self.resized_at, self.launched_from = (now if gpus else None), self.iteration
        return self.seq

    def launch(self, gpus: tuple[int, ...], now: float) -> int:
        self.phase, self.held = RunPhase.RUNNING, gpus
        seq = self.command(gpus, now)
        self.launched_at, self.resized_at = now, None
        return seq

    def move(self, gpus: tuple[int, ...], now: float) -> int:
        """Told to move to `gpus`: it claims them now and keeps what it has until it acknowledges."""
        self.held = tuple(sorted(set(self.held) | set(gpus)))
        return self.command(gpus, now)

    def leave(self) -> bool:
        """Cancelled: planned no more and never commanded again, so no GPU is
        given to it or taken from it while its process ends. True the first time."""
        first = not self.stopping
        self.stopping, self.target = True, ()
        return first

    def stop(self) -> int:
        """Told to checkpoint and end (and left, as `leave`)."""
        self.leave()
        self.seq += 1
        self.pending_seq, self.told_to_stop = self.seq, True
        return self.seq

    def acknowledge(self, seq: int, gpus: tuple[int, ...]) -> bool:
        """It applied command `seq` (or a later one): it holds only `gpus` now.
        True if that leaves it holding nothing."""
        if self.pending_seq is None or seq < self.pending_seq:
            return False
        if self.reported_gpus and tuple(gpus) != self.reported_gpus:  # its rate was at another width, and
            self.rate = Rate()  # the restart's standstill is in it
        self.pending_seq, self.held = None, tuple(gpus)
        return not self.held

    def report(self, iteration: int, gpus: tuple[int, ...], rate: float | None, projected: float | None,
               save_error: str | None = None) -> None:
        self.iteration, self.reported_gpus, self.reported_rate = iteration, gpus, rate
        self.own_projection, self.news, self.save_error = projected, True, save_error

    def first_iteration_since_launch(self) -> bool:
        """Whether it has trained since its launch (its start is then paid)."""
        return self.launched_at is not None and self.iteration > self.launched_from

    def started(self) -> None:
        self.launched_at = None

    @property
    def being_timed(self) -> bool:
        """A launch or resize whose first iteration is not seen yet: the look
        that sees it learns what starts cost (`StartCost`)."""
        return self.launched_at is not None or self.resized_at is not None

    def resized_in(self, now: float) -> float | None:
        """Once it trained on the set a resize gave it: how long that took
        from the command (once; None until then, and for a launch)."""
        if self.resized_at is None or self.iteration <= self.launched_from or self.reported_gpus != self.commanded:
            return None
        took, self.resized_at = now - self.resized_at, None
        return took

    def finish(self) -> None:
        self.phase, self.held, self.target, self.pending_seq = RunPhase.FINISHED, (), (), None

    def lose_gpus(self, mapping: dict[int, int]) -> bool:
        """The cluster changed: its GPU ids move to their new positions. True
        if some were on a node that is gone (its ranks went with it): it then
        waits for a new placement, and keeps holding what is left until it
        acknowledges one."""
        whole = all(g in mapping for g in (*self.held, *self.commanded))
        self.held = tuple(sorted(mapping[g] for g in self.held if g in mapping))
        self.commanded = tuple(sorted(mapping[g] for g in self.commanded if g in mapping)) if whole else ()
        self.target = ()
        return not whole

    # -- what the plans see ----------------------------------------------------
    def _look(self) -> tuple[float, float] | None:
        """One more observation of the rate it shows on the set it was told:
        its measured ratio then (an average of its observations), and the
        plan ratio that gives (only slower than the profile, at least 0.2);
        None when there is nothing to look at."""
        gpus = len(self.commanded) if self.phase == RunPhase.RUNNING else 0
        rate = self.reported_rate
        profiled = self.job.curve.points.get(gpus, 0.0) / self.speed_ratio if gpus else 0.0
        if not rate or rate <= 0 or profiled <= 0 or len(self.reported_gpus) != gpus:
            return None
        raw = rate / profiled  # against its profile
        measured = raw if self.measured_ratio is None else 0.5 * self.measured_ratio + 0.5 * raw
        return measured, min(1.0, max(0.2, measured))

    def _moves_plan(self, ratio: float) -> bool:
        return abs(ratio - self.speed_ratio) >= 0.03 * self.speed_ratio

    def observe(self) -> bool:
        """Once a slot: plan with the speed the run shows, not only its
        profile (a shared machine is slower than an idle one); True if that
        moved its curve. Only slower (a profile is the best case), at its
        measured ratio, and only a change of 3% or more is applied. Moving the
        plan's ratio 30% of the way to each observation under that same 3%
        rule froze it about 10% short of the truth: a run at 0.84 of its
        profile was planned at 0.92 all its life, and missed (dev102 under
        noise)."""
        look = self._look()
        if look is None:
            return False
        self.measured_ratio, ratio = look
        if not self._moves_plan(ratio):
            return False
        curve = self.job.curve
        base = {g: v / self.speed_ratio for g, v in curve.points.items()}
        self.speed_ratio = ratio
        self.job = replace(self.job, curve=type(curve)({g: v * ratio for g, v in base.items()}))
        return True

    def learnt(self) -> bool:
        """Whether another `observe` would change nothing: its measured ratio
        at its fixed point, and no change of plan speed due (a driver may
        then skip the slots until something happens)."""
        look = self._look()
        return look is None or look[0] == self.measured_ratio and not self._moves_plan(look[1])

    def on_kind(self, kind: str) -> None:
        """Placed on GPUs of `kind`: planned with its curve there from now on
        (the speed it showed elsewhere says nothing about this kind)."""
        if kind and kind != self.job.kind and kind in self.job.kinds:
            self.job = self.job.on(kind)
            self.speed_ratio, self.measured_ratio = 1.0, None

    def slipped(self, now: float, slack_s: float) -> bool:
        """Whether its finish, at the speed it has now, is more than `slack_s`
        past what the last plan projected: it fell behind the plan (a start
        slower than charged, a speed below its profile) and must be re-planned."""
        gpus = len(self.commanded)
        if self.phase != RunPhase.RUNNING or self.planned_finish is None or gpus not in self.job.curve.points:
            return False
        return now + max(0.0, self.job.iterations - self.iteration) / self.job.curve.speed(gpus) \
            > self.planned_finish + slack_s

    def due_between(self, since: float, now: float) -> bool:
        """Whether its deadline, as its plan has it, passed in (since, now]."""
        deadline = self.job.deadline
        return deadline is not None and since < deadline <= now

    def planned(self, finish: float) -> None:
        """The plan's projection of when it finishes."""
        self.planned_finish = finish

    def assessed(self) -> None:
        self.news = False

    def weigh_risk(self, risky: bool, safe: bool, now: float, hold_s: float) -> bool:
        """Hysteresis in value and in time: at risk once its projection has
        been `risky` (and never `safe`) for `hold_s`, recovered once it has
        been `safe` (and never `risky`) as long. A projection that swings
        across both bounds within seconds (a slow model's rate between two
        iterations, a plan's and a rate's projection taking turns) flips
        nothing. True if the flag flipped."""
        turning = safe if self.at_risk else risky
        holding = risky if self.at_risk else safe
        if holding:
            self.risk_turning_since = None
        elif turning and self.risk_turning_since is None:
            self.risk_turning_since = now
        if not turning or self.risk_turning_since is None or now - self.risk_turning_since < hold_s:
            return False
        self.at_risk, self.risk_turning_since = not self.at_risk, None
        return True

    def status(self, overhead: float, now: float, since_boundary_s: float, kind: str = "",
               at_measured_speed: bool = False) -> JobStatus:
        """Where it stands for a plan starting at the current slot's boundary
        (a plan made mid-slot counts the whole slot as usable). A running run
        gets back the work it did since the boundary. One not running yet
        cannot use the part of the slot gone: that costs it at most as much
        work as its fastest width does in that time, which is added to what
        is left, so a plan made mid-slot still holds (without it, newcomers
        decided late in a 240 s slot outran their plans and missed).

        `at_measured_speed`: what is left is said in iterations of its
        profile, so that the policy, which plans with the profile, plans the
        time it really needs: a run at 0.7 of its profile with 700 iterations
        left has 1000 profile iterations left (a policy told only the 700
        plans it as on time, and it falls behind again every slot)."""
        curve = self.job.curve
        if self.phase != RunPhase.RUNNING:
            return JobStatus(self.job.iterations + curve.speed(curve.levels[-1]) * since_boundary_s, 0, 0.0)
        gpus = len(self.commanded)
        overhead_left = max(0.0, overhead - (now - self.since)) if gpus else 0.0
        credit = curve.speed(gpus) * since_boundary_s if gpus else 0.0
        left = max(0.0, self.job.iterations - self.iteration + credit)
        return JobStatus(left / self.speed_ratio if at_measured_speed else left, gpus, overhead_left, kind)

    def cannot_make_it(self, now: float, widest: int, start_s: float) -> float | None:
        """Its finish at best, if even that is past its deadline: on the
        widest set it may have, at the speed it shows, after a restart."""
        curve = self.job.curve
        levels = curve.capped(widest)
        if self.deadline is None or not levels or self.phase == RunPhase.FINISHED or self.finishing:
            return None
        best = now + start_s + max(0.0, self.job.iterations - self.iteration) / curve.speed(levels[-1])
        return best if best > self.deadline else None

    def lose_guarantee(self) -> None:
        self.guarantee_lost = True

    def projected_finish(self, now: float) -> float | None:
        """Its own measured rate once it has shown one for a while; until then
        the plan's projection, which does not swing; the flow's own last."""
        finish = self.planned_finish if self.planned_finish is not None else self.own_projection
        if self.phase == RunPhase.RUNNING and self.iteration > 0:
            own = self.rate.projected(now, self.iteration, self.job.iterations)
            finish = own if own is not None else finish
        return finish

    def view(self, projected_finish: float | None, risk_margin_s: float) -> RunFacts:
        return RunFacts(self.run_id, self.phase, self.job.model, self.held, self.iteration, self.job.iterations,
                       self.deadline, self.plan_deadline, self.share, projected_finish, risk_margin_s, self.at_risk)
