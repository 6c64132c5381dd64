"""From the policy's placement to commands, every step of the loop: who
physically holds which GPU, and when a run may move.

Two rules keep GPUs changing hands in order:

- A GPU goes to a new holder only after its old holder released it. A running
  run's GPUs count as held until it acknowledges the command that gives them
  up; a run told to grow keeps its old GPUs and claims the new ones at once.
- A run whose new set is not free yet keeps running where it is, unless
  another run waits for its GPUs: then it is parked (checkpoints and holds
  nothing) until its new set is free. Parking needs nothing from anyone, so
  no cycle of runs waiting on each other can form.

And one rule spares restarts the plan did not price: a run nobody waits
for is not resized when the restart would cost more than it saves; a run
that reported its last iteration is not moved at all (a park would only
checkpoint a finished run, and tell its user it was parked). Nothing
else departs from the plan: a run another one waits for always follows it,
or the one that waits misses (a rule that let a deadline run keep its GPUs
for runs due later made an admitted run of dev102 miss by 190 s).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from scheduler_service.contracts import RunPhase
from scheduler_service.loop.actions import Action, Await, Launch, Park, Rescale
from scheduler_service.loop.run import LoopRun
from scheduler_service.policy.jobs import floor_pow2
from scheduler_service.policy.overhead import keeps_gpus


def actuate(runs: Iterable[LoopRun], reserved: set[int], change_s: Callable[[int, bool], float],
            now: float) -> list[Action]:
    """Commands that move running runs toward their targets, launches of
    waiting runs whose GPUs are free, and a word for those still waiting."""
    actions: list[Action] = []
    active = [r for r in runs if r.phase != RunPhase.FINISHED]

    def held_by_others(run: LoopRun) -> set[int]:
        return {g for r in active if r is not run for g in r.held} | reserved

    def wanted_by_others(run: LoopRun) -> set[int]:
        return {g for r in active if r is not run for g in r.target}

    for run in [r for r in active if r.phase == RunPhase.RUNNING and r.pending_seq is None and not r.stopping]:
        if run.target == run.commanded or run.save_error or run.finishing:
            # where it should be; or it cannot save, and a move would lose what it did since its last
            # save; or it is done and its GPUs come back when its process ends, moments from now
            continue
        if run.commanded and not set(run.commanded) & wanted_by_others(run) and not_worth_a_restart(run, change_s):
            continue  # nobody waits for what it holds: spare it a restart that costs more than it gains
        if run.target and not set(run.target) & held_by_others(run):
            actions.append(Rescale(run.run_id, run.move(run.target, now), run.target))
        elif run.commanded and (not run.target or set(run.commanded) & wanted_by_others(run)):
            actions.append(Park(run.run_id, run.command((), now)))
    waiting = sorted((r for r in active if r.phase == RunPhase.ADMITTED),
                     key=lambda r: (r.job.submit_time, r.run_id))
    for run in waiting:
        if run.target and not set(run.target) & held_by_others(run):
            actions.append(Launch(run.run_id, run.launch(run.target, now), run.target))
        else:
            actions.append(Await(run.run_id, placed=bool(run.target)))
    return actions


def not_worth_a_restart(run: LoopRun, change_s: Callable[[int, bool], float]) -> bool:
    """A resize costs a restart, or less in place (`change_s(gpus, in
    place)`). One that would outlast what is left of the run's work where it
    is does nothing but delay it (and whoever waits for its GPUs waits less
    than that restart); a grow must also save more than the restart: 5 s
    from the end, a second GPU that adds 8% saves 0.4 s and costs the
    restart, and the run finishes later than if left alone (a demo run ended
    1 s before its deadline that way)."""
    curve, here, there = run.job.curve, len(run.commanded), len(run.target)
    speed = curve.speed(here) if here in curve.points else 0.0
    if speed <= 0:
        return False
    left_s = max(0.0, run.job.iterations - run.iteration) / speed
    restart = change_s(max(1, there), keeps_gpus(run.commanded, run.target))
    if there > here and there in curve.points and curve.speed(there) > speed:
        return left_s * (1.0 - speed / curve.speed(there)) <= restart
    return left_s <= restart


def free_block(runs: Iterable[LoopRun], reserved: set[int], pools: Iterable[tuple[int, int]],
               largest: int) -> tuple[int, ...]:
    """The largest aligned power-of-two block, at most `largest` GPUs, inside
    one of `pools` ((first GPU, GPUs): one GPU kind each), that no run holds
    or is placed on and nothing reserved: () if none."""
    busy = reserved | {g for r in runs if r.phase != RunPhase.FINISHED for g in (*r.held, *r.target)}
    pools = list(pools)
    size = floor_pow2(min(largest, max(n for _, n in pools)))
    while size >= 1:
        for first, num_gpus in pools:
            for start in range(first, first + num_gpus - size + 1, size):
                if not busy & set(range(start, start + size)):
                    return tuple(range(start, start + size))
        size //= 2
    return ()
