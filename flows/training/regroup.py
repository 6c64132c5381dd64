"""A resize in place: the ranks that stay keep their state in memory, the ones
that join get it over the wire, and no checkpoint is written or read.

A segment launched with `SegmentSpec.in_place` does not end at a stop (a
resize the scheduler asked for, or the planned end of a `gpu_plan` step): its
ranks pause at that iteration boundary, rank 0 writes the round's result
(`result-<round>.json`, `paused`), and every rank waits for what the launcher
says next, a `Next` in `next-<round>.json` of the segment's folder:

- `regroup`: each rank finds its new order under its current rank, or none
  (it leaves). All of the round's ranks first drop their DDP wrapper and meet
  at a barrier while every peer is alive (a DDP reducer freed after a peer
  has gone can wait for ever); then the leavers exit, the others destroy the
  process group and form the new one with the newcomers, rank 0 (always one
  that stayed) broadcasting the model, optimizer, iteration, loss history and
  random state;
- `save`: a checkpoint where they stand, and exit (the run is parked, stopped,
  or goes on where the ranks cannot follow: a GPU set with none of theirs).

A rank that waits too long, or whose launcher is gone, or that is asked to
stop (SIGTERM) while it waits, saves and exits, as it would at the end of a
segment: a paused rank never outlives its run.

The coordinator side (`coordinator.segment_machine.Segment.regroup`, with
`plan_regroup` deciding who stays, joins and leaves) and the rank side
(`rank`) share these files and `Next`; pydantic and the standard library only.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Hashable, Literal

from pydantic import BaseModel, ConfigDict, Field

from flows.training.orders import RankOrder

PAUSE_LIMIT_S = 600.0  # a paused rank told nothing for this long saves and exits


class Next(BaseModel):
    """What the paused ranks of round `round - 1` do."""

    model_config = ConfigDict(extra="forbid")

    round: int = Field(ge=0, description="the round it starts (regroup), or the round that ends (save)")
    action: Literal["regroup", "save"]
    spec_file: str = Field("", description="the new round's SegmentSpec, in the segment's folder")
    orders: dict[int, RankOrder | None] = Field(default_factory=dict,
                                                description="by rank in the paused round: its new order, or None: it leaves")


@dataclass(frozen=True)
class RegroupPlan:
    """Who goes on from a paused round: the ranks that stay (in their order:
    the first is the new rank 0, and so holds the state to broadcast), the
    positions of the new set that newcomers take, and the ranks that leave."""

    stay: list[int]  # ranks of the paused round
    joining: list[int]  # indices into the new set
    leaving: list[int]  # ranks of the paused round

    def word(self, round_: int, orders: list[RankOrder], old_world: int) -> Next:
        """What the paused ranks are told: each one that stays, its order in
        the new round (the stayers hold its first orders); the others, None."""
        return Next(round=round_, action="regroup", spec_file=spec_file(round_),
                    orders={r: orders[self.stay.index(r)] if r in self.stay else None for r in range(old_world)})


def plan_regroup(old: list[tuple[int, Hashable]], new: list[tuple[int, Hashable]]) -> RegroupPlan:
    """From ranks on `old` to ranks on `new`, each a (GPU id, slot) per rank
    (a slot says where that GPU is: itself on one machine, its node and
    device on a cluster): a rank stays where its GPU is in the new set at the
    same slot; every other GPU of the new set gets a newcomer. No rank staying
    means no resize in place: the ranks save and the next segment starts anew."""
    place = dict(new)
    stay = [r for r, (gpu, slot) in enumerate(old) if place.get(gpu) == slot]
    kept = {old[r][0] for r in stay}
    return RegroupPlan(stay, [i for i, (gpu, _) in enumerate(new) if gpu not in kept],
                       [r for r in range(len(old)) if r not in stay])


def spec_file(round_: int) -> str:
    return "spec.json" if round_ == 0 else f"spec-{round_}.json"


def result_file(round_: int) -> str:
    return "result.json" if round_ == 0 else f"result-{round_}.json"


def next_file(round_: int) -> str:
    """The instruction for the ranks paused at the end of round `round_`."""
    return f"next-{round_}.json"


def write_private(path: Path, text: str, share: Callable[[Path], None] | None = None) -> None:
    """Atomically, readable by this account only (and, through `share`, by
    the run's ranks' account: before it takes its name, so that no rank ever
    sees the file and cannot read it)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", opener=lambda name, flags: os.open(name, flags, 0o600)) as fh:
        fh.write(text)
    if share is not None:
        share(tmp)
    os.replace(tmp, path)


def await_next(folder: Path, round_: int, go_on: Callable[[], bool], poll_s: float = 0.02,
               limit_s: float = PAUSE_LIMIT_S) -> Next | None:
    """The launcher's word for the ranks paused after `round_`; None when
    `go_on` says they must not wait any longer (asked to stop, orphaned) or
    nothing came in `limit_s`: they then save and exit."""
    path, give_up = folder / next_file(round_), time.time() + limit_s
    while time.time() < give_up and go_on():
        if path.exists():
            return Next.model_validate_json(path.read_text())
        time.sleep(poll_s)
    return None
