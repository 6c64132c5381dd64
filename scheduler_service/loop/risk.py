"""The one at-risk rule of the service, and the loss of a guarantee.

The run page, the cluster view, `elasticflow status` and the events all read
the flag this rule sets on a run (`LoopRun.at_risk`); none has a rule of its
own (three rules once disagreed, and the alerts flapped).

Hysteresis: at risk when the projection comes within the margin of the
deadline, recovered only once it is back beyond RECOVER_FACTOR margins, and
either only once the projection has stayed there RISK_HOLD_S (as long as a
rate needs to be measured: loop/run.py RATE_MIN_SPAN_S).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from scheduler_service.contracts import RunPhase
from scheduler_service.loop.actions import Action, GuaranteeLost, RiskChanged
from scheduler_service.loop.run import LoopRun
from scheduler_service.loop.start_cost import StartCost

RECOVER_FACTOR = 1.5
RISK_HOLD_S = 30.0


@dataclass(frozen=True)
class RiskRule:
    at_risk_s: float  # at risk when the projection comes this close to the deadline (at least a slot)
    interval_s: float
    defend: bool  # tell a guaranteed run at once when it can no longer make its deadline

    def changes(self, runs: Iterable[LoopRun], widest: int, start_cost: StartCost, now: float) -> list[Action]:
        """Running deadline runs whose outlook flipped since the last step. A
        run's outlook moves with what it reports (the worker reads every run
        at every poll), so only runs with news are assessed."""
        changes: list[Action] = []
        for run in runs:
            if run.phase != RunPhase.RUNNING or not run.news or run.stopping:  # a cancelled one has no outlook
                continue
            run.assessed()
            finish = run.projected_finish(now)  # samples its rate, for every running run
            if run.deadline is None:
                continue
            if self.defend and run.share is not None and not run.guarantee_lost:
                changes += self._lost(run, finish, widest, start_cost, now)
            margin = self.margin_of(run)
            risky = finish is not None and finish > run.deadline - margin
            safe = finish is None or finish <= run.deadline - margin * RECOVER_FACTOR
            if run.weigh_risk(risky, safe, now, RISK_HOLD_S):
                changes.append(RiskChanged(run.run_id, run.at_risk, finish, run.deadline))
        return changes

    def margin_of(self, run: LoopRun) -> float:
        return run.risk_margin(self.at_risk_s, self.interval_s)

    @staticmethod
    def _lost(run: LoopRun, finish: float | None, widest: int, start_cost: StartCost, now: float) -> list[Action]:
        """A guaranteed run that can no longer make its deadline, even on the
        widest set it may have at the speed it shows, is told so now, with
        its projected finish, not when the deadline passes."""
        levels = run.job.curve.capped(widest)
        on_widest = bool(levels) and len(run.commanded) == levels[-1]
        start_s = 0.0 if on_widest or not levels else start_cost.charge(levels[-1], False)
        best = run.cannot_make_it(now, widest, start_s)
        if best is None:
            return []
        run.lose_guarantee()
        return [GuaranteeLost(run.run_id, max(best, finish or best))]
