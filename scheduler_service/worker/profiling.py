"""Profiling a model on first use: its throughput at each GPU count, measured
on GPUs nobody uses, before the runs that need it can be decided.

Measurements run in a thread (a profile is real DDP processes and takes
seconds); the GPUs they use are reserved in the control loop meanwhile (a
`Reserved` event), so no run is launched or grown onto them. On a busy
cluster a profile waits, or measures the GPU counts that are free (more:
`elasticflow profile`).

On a cluster of several GPU kinds, the first profile measures one kind (the
one with free GPUs) and is the stand-in for the others, so the run is
decided at once. Each other kind is then measured when a block of it is
free and no run waits for a profile (`measure_later`): runs decided after
that plan with the kind's own curve. Runs already decided keep their plans;
what they show on the kind corrects their speed (loop/run.py).

A profile measured on fewer GPUs than the model could use here (the others
were busy) is partial: runs are decided on what it measured, and it is
completed (measured again on a wider block) the first time one is free and
no run waits for a profile (`complete_later`). A run the loop cannot decide
on a partial curve (it would be refused for want of GPU counts never
measured: `ProfileNeeded`) waits in Profiling for that completion instead
(`complete_for`), so a busy moment never caps a model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from scheduler_service.contracts import RejectionReason
from scheduler_service.loop.events import Event, Reserved, Unreserved
from scheduler_service.policy.topology import AnyTopology, kind_of, kinds_of
from scheduler_service.worker.intake import Request, usable_points
from scheduler_service.worker.registry import ServiceRun

log = logging.getLogger("prefect.workers.elasticflow.profiling")  # shown with the worker's own lines

Key = tuple[str, int, str]  # model, global batch size, device
KindKey = tuple[str, int, str, str]  # the same, on one GPU kind
# On these GPUs; True: a model's first profile, kept as the stand-in for the
# kinds not measured yet as well as the curve of the kind it ran on.
Measure = Callable[[Request, list[int], bool], dict[int, float]]


@dataclass(frozen=True, slots=True)
class ProfileOutcome:
    """A run whose wait in Profiling is over: its curve, or why there is none."""

    run: ServiceRun
    points: dict[int, float] | None
    reason: RejectionReason | None = None
    message: str = ""
    measured_up_to: int | None = None  # a partial curve: measured on at most this many GPUs (loop Arrived)


def widest_measured(device: str, batch_size: int, max_job_gpus: int) -> int:
    """The most GPUs a profile measures a model on here: what a run of it
    can use, and at most 4 CPU worker slots. A curve measured on fewer is partial."""
    return min(max_job_gpus, batch_size, 4 if device == "cpu" else max_job_gpus)


def _name(key: Key | KindKey) -> str:
    return f"profiling {key[0]}@{key[1]}" + (f" on {key[3]}" if len(key) > 3 else "")


class GpuLedger(Protocol):
    """What profiling asks of the control loop: where to measure, and who holds what."""

    @property
    def topology(self) -> AnyTopology: ...

    def free_block(self, largest: int, kind: str | None = None) -> tuple[int, ...]: ...

    def gpu_map(self) -> dict[int, str]: ...


class Profiler:
    def __init__(self, measure: Measure, device: str, timeout_s: float) -> None:
        self.measure = measure
        self.device = device
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="elasticflow-profile")
        self._running: dict[Key, Future[dict[int, float]]] = {}
        self._queued: dict[Key, Request] = {}  # waiting for free GPUs to measure on
        self._requests: dict[Key, Request] = {}  # what each running profile measures
        self._widths: dict[Key, int] = {}  # how many GPUs each running profile measures on
        self._blocked: set[Key] = set()  # already logged as waiting for GPUs
        self.waiting: dict[str, ServiceRun] = {}  # runs in Profiling
        self._later: dict[KindKey, Request] = {}  # kinds to measure when a block of them is free
        self._measuring: dict[KindKey, Future[dict[int, float]]] = {}
        self._measured: set[KindKey] = set()  # measured (or failed) on that kind in this life: not again
        self._narrow: dict[Key, int] = {}  # partial curves: measured on at most this many GPUs
        self._incomplete: dict[Key, Request] = {}  # partial curves to complete when a wider block is free
        self._completing: dict[Key, Future[dict[int, float]]] = {}  # one of them being measured again

    def wait_for(self, run: ServiceRun) -> None:
        request: Request = run.request
        if request.profile_key not in self._running:
            self._queued.setdefault(request.profile_key, request)
        self.waiting[run.run_id] = run

    def measure_later(self, request: Request, kinds: Iterable[str]) -> None:
        """Measure `request`'s model on each of `kinds` when a block of that
        kind is free: no run waits for it, and runs decided afterwards plan
        with it instead of the stand-in."""
        for kind in kinds:
            key = (*request.profile_key, kind)
            if key not in self._measured and key not in self._measuring:
                self._later.setdefault(key, request)

    def complete_later(self, request: Request, measured_up_to: int) -> None:
        """Its stored curve is partial: measure it again once a wider block is
        free and no run waits for a profile (runs meanwhile use what it measured)."""
        key = request.profile_key
        if key not in self._completing and key not in self._running:
            self._narrow[key] = measured_up_to
            self._incomplete[key] = request

    def complete_for(self, run: ServiceRun, measured_up_to: int) -> None:
        """The loop cannot decide `run` on its partial curve: it waits in
        Profiling for the curve's completion on a wider block, as for a first profile."""
        key = run.request.profile_key
        self._narrow[key] = measured_up_to
        self._incomplete.pop(key, None)
        self.wait_for(run)

    def forget(self, run_id: str) -> None:
        self.waiting.pop(run_id, None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def poll(self, now: float, cluster: GpuLedger, max_job_gpus: int) -> tuple[list[ProfileOutcome], list[Event]]:
        """Start what can start on `cluster`: the runs whose wait is over, and
        the GPUs reserved or given back meanwhile (for the loop)."""
        # Done as of now, once: a profile that ends later in this poll is
        # taken at the next one, so no ended profile keeps its GPUs reserved.
        done = {key for key, future in self._running.items() if future.done()}
        measured = {key for key, future in self._measuring.items() if future.done()}
        completed = {key for key, future in self._completing.items() if future.done()}
        reservations: list[Event] = [Unreserved(_name(key)) for key in [*done, *measured, *completed]]
        holders = self.holders(cluster, reserved=[e.holder for e in reservations])
        reservations += self._start(cluster, max_job_gpus, holders)
        for key in measured:
            self._settle(key, self._measuring.pop(key))
        for key in completed:
            self._settle(key, self._completing.pop(key))
        widest = {key: self._widths[key] for key in done}
        out = []
        for run_id, run in list(self.waiting.items()):
            request: Request = run.request
            future = self._running.get(request.profile_key)
            if future is None and now - run.taken_in_at > self.timeout_s:
                # Never started: the GPUs stayed busy. A profile that started ends
                # by itself (it has the same timeout) and is reported below.
                del self.waiting[run_id]
                why = self._no_gpus(request, now - run.taken_in_at, holders)
                out.append(ProfileOutcome(run, None, RejectionReason.PROFILING_FAILED, why))
                continue
            if future is None or request.profile_key not in done:
                continue
            del self.waiting[run_id]
            try:
                points = usable_points(future.result(), request.batch_size, max_job_gpus)
            except Exception as exc:  # profiling is the user's model running: any error is theirs to see
                out.append(ProfileOutcome(run, None, RejectionReason.PROFILING_FAILED, f"{type(exc).__name__}: {exc}"))
                continue
            partial = widest[request.profile_key] < self._widest(request, max_job_gpus)
            out.append(ProfileOutcome(run, points, measured_up_to=widest[request.profile_key] if partial else None))
        needed = {run.request.profile_key for run in self.waiting.values()}
        for key in done - needed:
            future, request, width = self._running.pop(key), self._requests.pop(key), self._widths.pop(key)
            if future.exception() is not None:
                continue
            self._narrow.pop(key, None)
            if width < self._widest(request, max_job_gpus):  # the GPUs were busy: measure the rest when free
                self.complete_later(request, width)
            self.measure_later(request, kinds_of(cluster.topology))  # the model runs: on the other kinds too
        for key in [k for k in self._queued if k not in needed]:  # its runs gave up waiting
            del self._queued[key]
        self._blocked &= set(self._queued)
        return out, reservations + self._start_later(cluster, max_job_gpus)

    def _no_gpus(self, request: Request, waited_s: float, holders: str) -> str:
        what = f"{request.model} at global batch {request.batch_size}"
        narrow = self._narrow.get(request.profile_key)
        if narrow is not None:
            return (f"its throughput was measured on {narrow} GPU(s) only (the others were busy), too few for its "
                    f"deadline, and no wider block was free to measure {what} on for {waited_s:.0f} s (held: "
                    f"{holders}); submit it again later")
        return (f"no GPUs were free to profile {what} for {waited_s:.0f} s (held: {holders}); submit it again "
                "later, or measure it first with `elasticflow profile`")

    def _start(self, cluster: GpuLedger, max_job_gpus: int, holders: str) -> list[Event]:
        started: list[Event] = []
        taken: set[int] = set()  # reserved in this poll, before the loop hears of it
        for key, request in list(self._queued.items()):
            gpus = cluster.free_block(self._widest(request, max_job_gpus))
            if not gpus or taken & set(gpus) or len(gpus) <= self._narrow.get(key, 0):
                if key not in self._blocked:
                    self._blocked.add(key)
                    log.info("profiling %s@%s waits for free GPUs (held: %s)", key[0], key[1], holders)
                continue
            self._blocked.discard(key)
            del self._queued[key]
            taken |= set(gpus)
            started.append(Reserved(_name(key), gpus))
            log.info("%s on GPUs %s", _name(key), ",".join(map(str, gpus)))
            self._measured.add((*key, kind_of(cluster.topology, gpus[0])))
            self._requests[key], self._widths[key] = request, len(gpus)
            self._running[key] = self._pool.submit(self.measure, request, list(gpus), True)
        return started

    def _start_later(self, cluster: GpuLedger, max_job_gpus: int) -> list[Event]:
        """One measurement no run waits for, if nothing else is measured or
        waits to be: a partial curve completed on a block wider than it was
        measured on (one kind of GPU only: on a cluster of kinds each kind is
        measured on its own), or a kind not measured yet on a free block of it."""
        if self._queued or self.waiting or any(not f.done() for f in [*self._running.values(),
                                                                     *self._measuring.values(),
                                                                     *self._completing.values()]):
            return []
        for key, request in list(self._incomplete.items()):
            gpus = () if kinds_of(cluster.topology) else cluster.free_block(self._widest(request, max_job_gpus))
            if len(gpus) <= self._narrow.get(key, 0):
                continue  # busy: tried again at the next poll
            del self._incomplete[key]
            self._narrow.pop(key, None)
            log.info("%s on GPUs %s: its curve was measured on fewer GPUs while they were busy (runs decided after "
                     "it plan with the whole curve)", _name(key), ",".join(map(str, gpus)))
            self._completing[key] = self._pool.submit(self.measure, request, list(gpus), True)
            if len(gpus) < self._widest(request, max_job_gpus):
                self.complete_later(request, len(gpus))  # wider still, another time
            return [Reserved(_name(key), gpus)]
        for key, request in list(self._later.items()):
            if key[3] not in kinds_of(cluster.topology):
                del self._later[key]  # that kind left the cluster
                continue
            gpus = cluster.free_block(self._widest(request, max_job_gpus), kind=key[3])
            if not gpus:
                continue  # busy: tried again at the next poll
            del self._later[key]
            self._measured.add(key)
            log.info("%s on GPUs %s: not measured on that kind yet (runs decided after it plan with it)", _name(key),
                     ",".join(map(str, gpus)))
            self._measuring[key] = self._pool.submit(self.measure, request, list(gpus), False)
            return [Reserved(_name(key), gpus)]
        return []

    @staticmethod
    def _settle(key: Key | KindKey, future: Future[dict[int, float]]) -> None:
        error = future.exception()
        if error is not None:  # the stand-in (or the partial curve) stays
            log.warning("%s failed (%s: %s); runs go on planning with the curve stored before", _name(key),
                        type(error).__name__, error)

    def _widest(self, request: Request, max_job_gpus: int) -> int:
        return widest_measured(self.device, request.batch_size, max_job_gpus)

    @staticmethod
    def holders(cluster: GpuLedger, reserved: Iterable[str] = ()) -> str:
        """Who holds which GPU, for messages about GPUs that are not free
        (`reserved`: holders giving theirs back now)."""
        held = {gpu: holder for gpu, holder in cluster.gpu_map().items()
                if holder.removeprefix("service:") not in reserved}
        return ", ".join(f"{gpu}: {holder}" for gpu, holder in sorted(held.items())) or "none"

    def sizes(self) -> dict[str, int]:
        return {"waiting": len(self.waiting), "running": len(self._running), "queued": len(self._queued),
                "blocked": len(self._blocked), "later": len(self._later), "measuring": len(self._measuring),
                "incomplete": len(self._incomplete), "completing": len(self._completing), "narrow": len(self._narrow)}


def measure_where_runs_train(device: str, iterations: int, timeout_s: float, cluster: Callable[[], Any],
                             ray_address: str | None) -> Measure:
    """The real measurement: DDP ranks of the user's model on the given GPUs,
    where a run on them would train (processes here, or Ray actors on the
    nodes of a Ray cluster: `cluster()` says where each GPU is), saved to the
    store for the next run of the same model and batch. On a cluster of
    several kinds the curve is kept as the kind's it was measured on, and, if
    it is the model's first profile (`stand_in`), as the stand-in for kinds
    not measured yet (intake.kind_curves). Measured on fewer GPUs than the
    model could use here, it is kept as partial."""
    def measure(request: Request, gpus: list[int], stand_in: bool) -> dict[int, float]:
        from flows.training.coordinator.profiler import profile_throughput
        from scheduler_service.store import save_curve

        params: Any = request.params
        now = cluster()
        placement = now.locate(tuple(gpus))
        counts = [1 << k for k in range(len(gpus).bit_length())]
        curve = profile_throughput(
            params.model, request.batch_size, counts, iterations=iterations, warmup=min(3, iterations - 2),
            device=device, model_kwargs=params.model_kwargs,
            dataset=params.dataset.model_dump() if params.dataset is not None else None, gpu_ids=gpus,
            timeout_s=timeout_s, ray_address=ray_address if placement is not None else None, placement=placement)
        kind = kind_of(now.topology, gpus[0])
        partial = len(gpus) < widest_measured(device, request.batch_size, now.topology.max_job_gpus)
        if stand_in or not kind:
            save_curve(params.model, request.batch_size, curve, device=device, partial=partial)
        if kind:
            save_curve(params.model, request.batch_size, curve, device=device, kind=kind, partial=partial)
        log.info("profiled %s@%s on %s%s: %s", params.model, request.batch_size,
                 ", ".join(now.nodes_of(gpus)), f" ({kind})" if kind else "",
                 ", ".join(f"{g} GPU(s) {r:.2f} it/s" for g, r in sorted(curve.items())))
        return curve

    return measure
