"""A segment's DDP ranks as Ray actors, each on the node and GPU its placement names.

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

import logging
import socket
import time
from typing import Any

from flows.training.ray_nodes import connect, loopback_before_import

loopback_before_import()

import ray  # noqa: E402

from flows.training.control import FileControlChannel, GpuSlot  # noqa: E402
from flows.training.orders import RankOrder, rank_orders  # noqa: E402
from flows.training.regroup import Next, next_file, spec_file  # noqa: E402
from flows.training.rank.ray_actor import MisplacedRank  # noqa: E402
from flows.training.coordinator.ray_pool import ActorPool, end_actors, spares_per_node  # noqa: E402
from flows.training.coordinator.ray_where import answers, lost, ray_seats, slots_for  # noqa: E402
from flows.training.segment import SegmentResult, SegmentSpec  # noqa: E402
from flows.training.supervision import (  # noqa: E402
    HANDOVER_S,
    Failure,
    ProgressCallback,
    RankFailure,
    crash_result,
    crashed,
)

log = logging.getLogger("elasticflow.ray")
# A rank that is gone or cannot be reached: dead, on a node Ray gave up (an
# actor pinned there is then unschedulable, not dead: a segment started on a
# plan made a moment before its node died failed the whole run once), or silent.
RANKS_GONE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnschedulableError, ray.exceptions.GetTimeoutError)


class CheckpointStoreNotShared(ValueError):
    """Ranks on other machines cannot reach a local checkpoint folder."""


def _is_local_path(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def _remote_spec(spec: SegmentSpec) -> str:
    """The spec as the actors get it: they read no control folder (the
    coordinator forwards the scheduler's stop)."""
    return spec.model_copy(update={"control_dir": None}).model_dump_json()


class RaySegment:
    """A running segment on Ray (a `supervision.RunningSegment`)."""

    def __init__(self, spec: SegmentSpec, gpus: list[int], placement: list[GpuSlot], pool: ActorPool,
                 control: FileControlChannel | None = None) -> None:
        if not gpus or len(placement) != len(gpus):
            raise ValueError("a segment needs one slot per GPU")
        self.spec, self.gpus, self.placement, self.pool, self.control = spec, list(gpus), placement, pool, control
        self.actors: list[Any] = []
        self.refs: list[Any] = []
        self.where: list[dict[str, Any]] = []
        self.orders: list[RankOrder] = []
        self.launch_t = 0.0
        self._offset = 0  # in rank 0's progress file
        self._iteration = 0  # the last one rank 0 reported
        self._stop_sent = False
        self.start_error: str | None = None
        self.died = False  # a rank's process died under it (killed, or its node lost)
        self.round = 0  # resizes in place so far
        self.paused: SegmentResult | None = None  # its ranks wait in memory for the next round
        self._released: SegmentResult | None = None  # what they said when they saved and left

    @property
    def pids(self) -> list[int]:
        return [w["pid"] for w in self.where]

    @property
    def nodes(self) -> list[str]:
        return sorted({slot.name for slot in self.placement})

    def start(self) -> None:
        """Hand each rank its part. Ranks that cannot start (a node going
        away) make the segment a crash, as a rank failing later would."""
        self.launch_t = time.time()
        self.actors = [self.pool.take(slot) for slot in self.placement]
        try:
            self._start()
        except (MisplacedRank, *RANKS_GONE) as exc:
            self.died = self.died or isinstance(exc, (ray.exceptions.RayActorError,
                                                      ray.exceptions.ActorUnschedulableError))
            self.start_error = f"ranks could not start on {', '.join(self.nodes)}: {type(exc).__name__}: {exc}"

    def _start(self) -> None:
        self.where = ray.get([a.where.remote() for a in self.actors], timeout=HANDOVER_S)
        for rank, (slot, where) in enumerate(zip(self.placement, self.where)):
            if where["node"] != slot.node:  # hard affinity makes this impossible; check anyway
                raise MisplacedRank(f"rank {rank} landed on node {where['node']}, not {slot.node} ({slot.name})")
        elsewhere = sorted({w["host"] for w in self.where} - {socket.gethostname()})
        if elsewhere and _is_local_path(self.spec.checkpoint_url):
            raise CheckpointStoreNotShared(
                f"checkpoint_store {self.spec.checkpoint_url!r} is a folder on {socket.gethostname()}, but ranks of "
                f"this run are on {', '.join(elsewhere)}: set the CheckpointStore block's url (or the run's "
                "checkpoint_store) to a URL every node reaches, e.g. s3://bucket/checkpoints")
        master_ip = self.where[0]["ip"]
        port = ray.get(self.actors[0].free_port.remote(master_ip), timeout=HANDOVER_S)
        self.orders = rank_orders(ray_seats(self.placement, self.where), master_ip, port, self.spec.device,
                                  self.launch_t, self.gpus)
        spec_json = _remote_spec(self.spec)
        self.refs = [actor.run.remote(spec_json, order) for actor, order in zip(self.actors, self.orders)]
        log.debug("segment started on Ray run_key=%s gpus=%s nodes=%s master=%s:%d", self.spec.run_key, self.gpus,
                  ",".join(self.nodes), master_ip, port)

    def regroup(self, spec: SegmentSpec, gpus: list[int], placement: list[GpuSlot] | None = None) -> bool:
        """Go on in place on `gpus` at `placement` (regroup.py): the actors on
        slots that stay keep their state, the others leave and are ended,
        newcomers from the pool join and get it from them. Returns once the
        leavers' processes are gone; False, telling the ranks nothing, when
        it cannot: not paused, no slot stays, a rank gone, or a newcomer that
        cannot start (then `release` it). A rank lost once they were told
        makes the segment a crash, which its `wait` reports."""
        if self.paused is None:
            return False
        try:
            slots = list(placement) if placement is not None else slots_for(gpus)
        except ValueError:  # GPUs the cluster does not have: the segment that tries them will say so
            return False
        place = dict(zip(gpus, slots))
        stay = [r for r, (gpu, slot) in enumerate(zip(self.gpus, self.placement)) if place.get(gpu) == slot]
        done, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        if not stay or done:
            return False
        joining = [gpu for gpu in gpus if gpu not in {self.gpus[r] for r in stay}]
        joiners = [self.pool.take(place[gpu]) for gpu in joining]
        try:
            arrived = ray.get([a.where.remote() for a in joiners], timeout=HANDOVER_S)
            if any(w["node"] != place[gpu].node for w, gpu in zip(arrived, joining)):
                raise MisplacedRank(f"a newcomer is not on its node: {arrived}")
            master_ip = self.where[stay[0]]["ip"]
            port = ray.get(self.actors[stay[0]].free_port.remote(master_ip), timeout=HANDOVER_S)
        except (MisplacedRank, *RANKS_GONE) as exc:
            log.warning("no resize in place run_key=%s: newcomers could not start (%s: %s)", spec.run_key,
                        type(exc).__name__, exc)
            for actor in joiners:
                ray.kill(actor, no_restart=True)
            return False
        new_gpus = [self.gpus[r] for r in stay] + joining
        new_placement = [self.placement[r] for r in stay] + [place[gpu] for gpu in joining]
        new_where = [self.where[r] for r in stay] + arrived
        self.launch_t = time.time()
        orders = rank_orders(ray_seats(new_placement, new_where), master_ip, port, spec.device, self.launch_t,
                             new_gpus)
        ended, self.round = self.round, self.round + 1
        spec_json = _remote_spec(spec)
        word = Next(round=self.round, action="regroup", spec_file=spec_file(self.round),
                    orders={r: orders[stay.index(r)] if r in stay else None for r in range(len(self.gpus))})
        try:
            ray.get([a.tell.remote({spec_file(self.round): spec_json, next_file(ended): word.model_dump_json()})
                     for a in self.actors], timeout=HANDOVER_S)
        except RANKS_GONE as exc:
            # Some ranks may be forming the new group already: a crash, as a
            # rank lost at any other moment; the run goes on from its checkpoint.
            end_actors(self.actors + joiners, self.where + arrived)
            self.paused, self.died = None, True
            self.start_error = f"a rank was lost while the ranks regrouped: {type(exc).__name__}: {exc}"
            return True
        joined = [a.run.remote(spec_json, order, self.round, True) for a, order in zip(joiners, orders[len(stay):])]
        leavers = [r for r in range(len(self.gpus)) if r not in stay]
        left_actors, left_where = [self.actors[r] for r in leavers], [self.where[r] for r in leavers]
        left_refs = [self.refs[r] for r in leavers]
        if self.actors[0] is not self.actors[stay[0]]:
            self._offset = 0  # rank 0's progress is a file of the new rank 0's
        self.actors = [self.actors[r] for r in stay] + joiners
        self.refs = [self.refs[r] for r in stay] + joined
        self.spec, self.gpus, self.placement, self.where, self.orders = spec, new_gpus, new_placement, new_where, orders
        self.paused, self._stop_sent = None, False
        ray.wait(left_refs, num_returns=len(left_refs), timeout=30.0)  # past the old group's last barrier
        end_actors(left_actors, left_where)
        log.info("segment resized in place on Ray run_key=%s round=%d gpus=%s (%d stay, %d join, %d leave)",
                 spec.run_key, self.round, new_gpus, len(stay), len(joiners), len(leavers))
        return True

    def release(self) -> SegmentResult | None:
        """A paused segment that does not go on in place: its ranks save where
        they stand, and every actor is ended; their last result (None if they
        could not say), the same when asked again."""
        if self.paused is None:
            return self._released
        self.paused = None
        try:
            ray.get([a.tell.remote({next_file(self.round): Next(round=self.round, action="save").model_dump_json()})
                     for a in self.actors], timeout=HANDOVER_S)
            said = ray.get(self.refs, timeout=120.0)
        except Exception as exc:  # noqa: BLE001  # a rank gone, or stuck: they saved or did not, the store says
            log.warning("paused ranks did not save and end run_key=%s: %s: %s", self.spec.run_key,
                        type(exc).__name__, exc)
            return None
        finally:
            end_actors(self.actors, self.where)
        result = SegmentResult.model_validate_json(said[0])
        result.gpus = self.gpus
        self._released = result
        return result

    def request_stop(self) -> None:
        self._stop(terminate=True)

    def _stop(self, terminate: bool, seq: int = 0) -> None:
        for actor in self.actors:
            actor.stop.remote(terminate, seq)

    def kill(self, grace_s: float = 5.0) -> None:
        if self.refs:
            self.request_stop()
            ray.wait(self.refs, num_returns=len(self.refs), timeout=grace_s)
        end_actors(self.actors, self.where)

    def _pause_near(self) -> bool:
        """The ranks are about to pause (a stop was sent, or the segment's
        last iteration is near): a resize in place waits for the flow to
        notice, so it looks four times as often then."""
        return self.spec.in_place and (self._stop_sent or self._iteration >= self.spec.stop_at - 2)

    def _progress(self, on_progress: ProgressCallback | None) -> SegmentResult | None:
        """Forward rank 0's new progress lines; its result if the ranks paused."""
        try:
            lines, self._offset, said = ray.get(self.actors[0].progress.remote(self._offset, self.round), timeout=10)
        except RANKS_GONE:
            return None
        for line in lines:
            self._iteration = line.iteration
            if on_progress:
                on_progress(line)
        result = SegmentResult.model_validate_json(said) if said and self.spec.in_place else None
        if result is None or not result.paused:
            return None
        result.gpus = self.gpus
        return result

    def _failures(self, done: list[Any]) -> list[RankFailure]:
        """Ranks that failed, once one has. The others are given a moment to
        fail too: Ray may report a peer's error before the death that caused
        it, and the cause is told from its casualties only among all of them."""
        def failed(refs: list[Any]) -> list[RankFailure]:
            out = []
            for ref in refs:
                try:
                    ray.get(ref, timeout=0)
                except ray.exceptions.GetTimeoutError:
                    continue
                except Exception as exc:  # noqa: BLE001  # whatever a rank raised, or its death
                    rank = self.refs.index(ref)
                    how = Failure.DIED if isinstance(exc, ray.exceptions.RayActorError) else Failure.FAILED
                    out.append(RankFailure(rank, how, f"{how.value}: {type(exc).__name__}", self.placement[rank].name,
                                           str(exc)[:1500]))
            return out

        if not failed(done):
            return []
        more, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=3.0)
        return failed(more)

    def _log_tail(self, failure: RankFailure) -> str:
        """What a rank that raised wrote last (a rank that died took its log's actor along)."""
        if failure.how is Failure.DIED:
            return ""
        try:
            return str(ray.get(self.actors[failure.rank].log_tail.remote(), timeout=5))
        except Exception:  # noqa: BLE001  # gone meanwhile
            return ""

    def wait(self, on_progress: ProgressCallback | None = None, timeout_s: float | None = None,
             poll_s: float = 0.2) -> SegmentResult:
        give_up = None if timeout_s is None else time.time() + timeout_s
        try:
            if self.start_error:
                log.warning("segment could not start on Ray run_key=%s: %s", self.spec.run_key, self.start_error)
                return crashed(self.gpus, self.launch_t, self.start_error)
            while True:
                done, _ = ray.wait(self.refs, num_returns=len(self.refs),
                                   timeout=poll_s / 4 if self._pause_near() else poll_s)
                paused = self._progress(on_progress)
                failures = self._failures(done)
                if failures:
                    self.died = any(f.how is Failure.DIED for f in failures)
                    result, cause = crash_result(self.gpus, self.launch_t, failures, self._log_tail)
                    log.warning("segment crashed on Ray run_key=%s rank=%d node=%s how=%s", self.spec.run_key,
                                cause.rank, cause.node, cause.how.value)
                    return result
                if paused is not None:  # the ranks wait for `regroup` or `release`
                    self.paused = paused
                    return paused
                if len(done) == len(self.refs):
                    self._progress(on_progress)
                    break
                if give_up is not None and time.time() > give_up:
                    return crashed(self.gpus, self.launch_t, f"did not finish in {timeout_s:.0f} s")
                command = self.control.pending(self.spec.applied_seq) if self.control and not self._stop_sent else None
                if command is not None:
                    self._stop(terminate=False, seq=command.seq)  # rank 0 polled this file when it could see it
                    self._stop_sent = True
            result = SegmentResult.model_validate_json(ray.get(self.refs[0]))
            result.gpus = self.gpus
            ray.get([a.cleanup.remote() for a in self.actors], timeout=30)
            return result
        finally:
            if self.paused is None:
                end_actors(self.actors, self.where)


class RayRanks:
    """Ranks as Ray actors on the nodes each segment's placement names, warm
    spares per node in the run's `ActorPool` (a `ranks.Ranks`)."""

    in_place = True

    def __init__(self, address: str, run_key: str, control: FileControlChannel | None) -> None:
        connect(address)
        self.pool = ActorPool(run_key, spares_per_node())
        self.control = control
        self.last: RaySegment | None = None

    def segment(self, spec: SegmentSpec, gpus: list[int], placement: list[GpuSlot] | None) -> RaySegment:
        """On the slots the scheduler named (a run without one: the GPU ids on the live nodes, by name)."""
        slots = list(placement) if placement is not None else slots_for(gpus)
        self.last = RaySegment(spec, gpus, slots, self.pool, self.control)
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
        here = dict(zip(segment.gpus, segment.placement))
        try:
            placement = [here[g] for g in upcoming] if set(upcoming) <= set(here) else slots_for(upcoming)
        except ValueError:  # a plan naming GPUs the cluster no longer has: the segment will say so
            placement = segment.placement
        self.pool.refill(placement)

    def lost_nodes(self, verdict_s: float = 60.0) -> list[str]:
        """After a crash: the last segment's nodes that are gone. A rank that
        died may be its node going: Ray's verdict (missed heartbeats) comes
        within seconds, so it is awaited for a while."""
        segment = self.last
        if segment is None:
            return []
        give_up = time.monotonic() + (verdict_s if segment.died else 0.0)
        if segment.died and all(answers(node) for node in {slot.node for slot in segment.placement}):
            return []  # a rank's process died, not its node: restart where it was
        while True:
            gone = lost(segment.placement)
            if gone:
                self.pool.drop({slot.node for slot in segment.placement})
                return gone
            if time.monotonic() >= give_up:
                return []
            time.sleep(0.5)

    def close(self) -> None:
        self.pool.close()
