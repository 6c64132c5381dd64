"""A segment's DDP ranks as Ray actors, each on the node and GPU its placement
names: the Ray transport of a segment (`segment_machine.Segment`, which
supervises it), and the run's `RayRanks`.

The run's flow process stays where Prefect's worker started it and coordinates:
it is the Ray driver that owns the actors (so they die with it), hands each
rank its segment, forwards the scheduler's stop (ranks read no control folder,
which a remote node could not see) and collects the result. Ray decides
nothing: an actor is pinned to its node (hard node affinity) and its GPU is set
by us (`CUDA_VISIBLE_DEVICES`, with Ray told not to set it), and the actor
says where it landed before it is given any work.

One actor is one rank of one segment, across its resizes in place
(regroup.py): at a stop the actors pause with the model in memory; those on
slots that stay form the next round's group with newcomers from the pool,
which get the state by broadcast, and those that leave are ended, which
frees their GPUs. A resize that cannot be made in place (no slot stays, a
rank is gone) saves and ends every actor, and the next segment starts from
that checkpoint on others. Warm actors (torch imported, no device touched)
wait per node in `ActorPool` (ray_pool.py), so neither pays for an
interpreter and its imports.

Where ranks are on the live cluster (slots, seats, nodes lost) is
ray_where.py's.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from dataclasses import dataclass
from typing import Any

from flows.training.ray_nodes import connect, loopback_before_import

loopback_before_import()

import ray  # noqa: E402

from flows.training.control import GpuSlot  # noqa: E402
from flows.training.coordinator.ray_pool import ActorPool, end_actors, spares_per_node  # noqa: E402
from flows.training.coordinator.ray_where import answers, lost, ray_seats, slots_for  # noqa: E402
from flows.training.coordinator.segment_machine import RanksGone, Segment  # noqa: E402
from flows.training.orders import RankOrder, rank_orders  # noqa: E402
from flows.training.rank.ray_actor import MisplacedRank  # noqa: E402
from flows.training.segment import SegmentSpec  # noqa: E402
from flows.training.supervision import HANDOVER_S, Failure, ProgressLine, RankFailure  # noqa: E402

log = logging.getLogger("elasticflow.ray")
# A rank that is gone or cannot be reached: any error of Ray's own about it.
# Dead, on a node Ray gave up (an actor pinned there is then unschedulable, not
# dead: a segment started on a plan made a moment before its node died failed
# the whole run once), its node or worker dead, its environment not set up on
# a node going away, or silent. Named one by one, the next kind a raylet kill
# raised at a start failed a run at iteration 0 instead of restarting it.
RANKS_GONE = (ray.exceptions.RayError,)
SILENT = (ray.exceptions.GetTimeoutError, MisplacedRank)  # not known to be dead


class CheckpointStoreNotShared(ValueError):
    """Ranks on other machines cannot reach a local checkpoint folder."""


def _is_local_path(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


@dataclass
class RayRank:
    """A rank actor: where it landed once asked, its `run` once handed its part."""

    actor: Any
    slot: GpuSlot
    where: dict[str, Any] | None = None
    ref: Any = None
    offset: int = 0  # in its progress file, should it be rank 0
    ended: bool = False


class RayActors:
    """The Ray transport: every rank an actor pinned to its slot's node,
    taken warm from the run's `ActorPool`; told through calls, since their
    folders are on their own nodes."""

    poll_s = 0.2

    def __init__(self, pool: ActorPool) -> None:
        self.pool = pool

    def slots(self, gpus: list[int], placement: list[GpuSlot] | None) -> list[GpuSlot]:
        """The slots the scheduler named (a run without one: the GPU ids on the live nodes, by name)."""
        slots = list(placement) if placement is not None else slots_for(gpus)
        if len(slots) != len(gpus):
            raise ValueError("a segment needs one slot per GPU")
        return slots

    def take(self, slots: list[GpuSlot]) -> list[RayRank]:
        taken: list[RayRank] = []
        try:
            for slot in slots:
                taken.append(RayRank(self.pool.take(slot), slot))
        except RANKS_GONE as exc:  # the cluster could not even be asked for them: none is left behind
            with contextlib.suppress(Exception):
                self.end(taken, 0.0)
            raise RanksGone(f"ranks could not be created: {type(exc).__name__}: {exc}", died=False) from exc
        return taken

    def meet(self, ranks: list[RayRank], gpus: list[int], spec: SegmentSpec, launch_t: float) -> list[RankOrder]:
        """Each new rank says where it landed (hard affinity makes another
        node impossible; checked anyway); the group meets at the first's."""
        new = [rank for rank in ranks if rank.where is None]
        try:
            for rank, where in zip(new, ray.get([rank.actor.where.remote() for rank in new], timeout=HANDOVER_S)):
                rank.where = where
            for r, rank in enumerate(ranks):
                if rank.where["node"] != rank.slot.node:  # type: ignore[index]
                    raise MisplacedRank(f"rank {r} landed on node {rank.where['node']}, not {rank.slot.node} "  # type: ignore[index]
                                        f"({rank.slot.name})")
            where = [rank.where for rank in ranks]
            elsewhere = sorted({w["host"] for w in where} - {socket.gethostname()})  # type: ignore[index]
            if elsewhere and _is_local_path(spec.checkpoint_url):
                raise CheckpointStoreNotShared(
                    f"checkpoint_store {spec.checkpoint_url!r} is a folder on {socket.gethostname()}, but ranks of "
                    f"this run are on {', '.join(elsewhere)}: set the CheckpointStore block's url (or the run's "
                    "checkpoint_store) to a URL every node reaches, e.g. s3://bucket/checkpoints")
            master_ip = where[0]["ip"]  # type: ignore[index]
            port = ray.get(ranks[0].actor.free_port.remote(master_ip), timeout=HANDOVER_S)
        except (MisplacedRank, *RANKS_GONE) as exc:
            nodes = ", ".join(sorted({rank.slot.name for rank in ranks}))
            raise RanksGone(f"ranks could not start on {nodes}: {type(exc).__name__}: {exc}",
                            died=not isinstance(exc, SILENT)) from exc
        log.debug("ranks meet on Ray run_key=%s gpus=%s master=%s:%d", spec.run_key, gpus, master_ip, port)
        return rank_orders(ray_seats([rank.slot for rank in ranks], where), master_ip, port, spec.device, launch_t,
                           gpus)  # type: ignore[arg-type]

    def hand_over(self, ranks: list[RayRank], orders: list[RankOrder], spec: SegmentSpec, round_: int,
                  joins: bool) -> None:
        spec_json = spec.model_dump_json()
        for rank, order in zip(ranks, orders):
            rank.ref, rank.offset = rank.actor.run.remote(spec_json, order, round_, joins), 0

    def tell(self, ranks: list[RayRank], files: dict[str, str]) -> None:
        try:
            ray.get([rank.actor.tell.remote(files) for rank in ranks], timeout=HANDOVER_S)
        except RANKS_GONE as exc:
            raise RanksGone(f"{type(exc).__name__}: {exc}", died=True) from exc

    def progress(self, rank0: RayRank, round_: int) -> tuple[list[ProgressLine], str]:
        try:
            lines, rank0.offset, said = ray.get(rank0.actor.progress.remote(rank0.offset, round_), timeout=10)
        except RANKS_GONE:
            return [], ""
        return lines, said

    def watch(self, ranks: list[RayRank], launch_t: float) -> tuple[bool, list[RankFailure]]:
        """Ranks that failed, once one has. The others are given a moment to
        fail too: Ray may report a peer's error before the death that caused
        it, and the cause is told from its casualties only among all of them."""
        refs = [rank.ref for rank in ranks]

        def failed(done: list[Any]) -> list[RankFailure]:
            out = []
            for ref in done:
                try:
                    ray.get(ref, timeout=0)
                except ray.exceptions.GetTimeoutError:
                    continue
                except Exception as exc:  # noqa: BLE001  # whatever a rank raised, or its death
                    r = refs.index(ref)
                    how = Failure.DIED if isinstance(exc, ray.exceptions.RayActorError) else Failure.FAILED
                    out.append(RankFailure(r, how, f"{how.value}: {type(exc).__name__}", ranks[r].slot.name,
                                           str(exc)[:1500]))
            return out

        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        if not failed(done):
            return len(done) == len(refs), []
        more, _ = ray.wait(refs, num_returns=len(refs), timeout=3.0)
        return False, failed(more)

    def idle(self, ranks: list[RayRank], seconds: float) -> None:
        refs = [rank.ref for rank in ranks]
        ray.wait(refs, num_returns=len(refs), timeout=seconds)

    def result(self, ranks: list[RayRank], round_: int, wait_s: float) -> str | None:
        """Rank 0's return; their folders go once they ended well."""
        try:
            said = ray.get([rank.ref for rank in ranks], timeout=max(wait_s, 10.0))
            ray.get([rank.actor.cleanup.remote() for rank in ranks], timeout=30)
        except Exception as exc:  # noqa: BLE001  # a rank gone, or stuck: they saved or did not, the store says
            log.warning("ranks did not end well on Ray: %s: %s", type(exc).__name__, exc)
            return None
        return str(said[0]) or None

    def stop(self, ranks: list[RayRank], terminate: bool, seq: int = 0) -> None:
        for rank in ranks:
            rank.actor.stop.remote(terminate, seq)

    def end(self, ranks: list[RayRank], wait_s: float) -> None:
        """Killed once their `run` returned or `wait_s` passed; returns once
        their processes are gone (ray_pool.end_actors)."""
        live = [rank for rank in ranks if not rank.ended]
        refs = [rank.ref for rank in live if rank.ref is not None]
        if refs and wait_s > 0:
            ray.wait(refs, num_returns=len(refs), timeout=wait_s)
        placed = [rank for rank in live if rank.where is not None]
        for rank in live:
            if rank.where is None:
                ray.kill(rank.actor, no_restart=True)
            rank.ended = True
        end_actors([rank.actor for rank in placed], [rank.where for rank in placed])  # type: ignore[misc]

    def gone(self, ranks: list[RayRank]) -> bool:
        refs = [rank.ref for rank in ranks]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return bool(done)

    def log_tail(self, ranks: list[RayRank], failure: RankFailure) -> str:
        """What a rank that raised wrote last (a rank that died took its log's actor along)."""
        if failure.how is Failure.DIED or failure.rank >= len(ranks):
            return ""
        try:
            return str(ray.get(ranks[failure.rank].actor.log_tail.remote(), timeout=5))
        except Exception:  # noqa: BLE001  # gone meanwhile
            return ""

    def after(self, ranks: list[RayRank], paused: bool) -> None:
        if not paused:
            self.end(ranks, 0.0)

    def pids(self, ranks: list[RayRank]) -> list[int]:
        return [rank.where["pid"] for rank in ranks if rank.where is not None]


class RayRanks:
    """Ranks as Ray actors on the nodes each segment's placement names, warm
    spares per node in the run's `ActorPool` (a `ranks.Ranks`)."""

    in_place = True

    def __init__(self, address: str, run_key: str) -> None:
        connect(address)
        self.pool = ActorPool(run_key, spares_per_node())
        self.last: Segment | None = None

    def segment(self, spec: SegmentSpec, gpus: list[int], placement: list[GpuSlot] | None) -> Segment:
        self.last = Segment(spec, gpus, RayActors(self.pool), placement)
        return self.last

    def refill(self, upcoming: list[int]) -> None:
        """One warm actor for each GPU the next segment will likely want, on
        its node: the current placement when the scheduler steers (where it
        sends the run next is not known), the next planned set's when the
        run's own plan says, so that a grow onto another node finds warm
        actors there (without, it waited 3 s here for one started cold)."""
        segment = self.last
        if not upcoming or segment is None:
            return
        here = dict(zip(segment.gpus, segment.slots))
        try:
            placement = [here[g] for g in upcoming] if set(upcoming) <= set(here) else slots_for(upcoming)
        except ValueError:  # a plan naming GPUs the cluster no longer has: the segment will say so
            placement = list(segment.slots)
        self.pool.refill(placement)

    def lost_nodes(self, verdict_s: float = 60.0) -> list[str]:
        """After a crash: the last segment's nodes that are gone. A rank that
        died may be its node going: Ray's verdict (missed heartbeats) comes
        within seconds, so it is awaited for a while."""
        segment = self.last
        if segment is None:
            return []
        give_up = time.monotonic() + (verdict_s if segment.died else 0.0)
        slots: list[GpuSlot] = list(segment.slots)  # type: ignore[arg-type]
        if segment.died and all(answers(node) for node in {slot.node for slot in slots}):
            return []  # a rank's process died, not its node: restart where it was
        while True:
            gone = lost(slots)
            if gone:
                self.pool.drop({slot.node for slot in slots})
                return gone
            if time.monotonic() >= give_up:
                return []
            time.sleep(0.5)

    def close(self) -> None:
        self.pool.close()
