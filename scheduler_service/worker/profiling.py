"""Profiling a model on first use: its throughput at each GPU count, measured
on GPUs nobody uses, before the runs that need it can be decided.

Measurements run in a thread (a profile is real DDP processes and takes
seconds); the GPUs they use are reserved in the control loop meanwhile (a
`Reserved` event), so no run is launched or grown onto them. On a busy
cluster a profile waits, or measures the GPU counts that are free (more:
`elasticflow profile`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from scheduler_service.contracts import RejectionReason
from scheduler_service.loop.events import Event, Reserved, Unreserved
from scheduler_service.worker.intake import Request, usable_points
from scheduler_service.worker.registry import ServiceRun

log = logging.getLogger("prefect.workers.elasticflow.profiling")  # shown with the worker's own lines

Key = tuple[str, int, str]  # model, global batch size, device
Measure = Callable[[Request, list[int]], dict[int, float]]


@dataclass(frozen=True, slots=True)
class Outcome:
    """A run whose wait in Profiling is over: its curve, or why there is none."""

    run: ServiceRun
    points: dict[int, float] | None
    reason: RejectionReason | None = None
    message: str = ""


def _name(key: Key) -> str:
    return f"profiling {key[0]}@{key[1]}"


class Cluster(Protocol):
    """What profiling asks of the control loop: where to measure, and who holds what."""

    def free_block(self, largest: int) -> tuple[int, ...]: ...

    def gpu_map(self) -> dict[int, str]: ...


class Profiler:
    def __init__(self, measure: Measure, device: str, timeout_s: float) -> None:
        self.measure = measure
        self.device = device
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="elasticflow-profile")
        self._running: dict[Key, Future[dict[int, float]]] = {}
        self._queued: dict[Key, Request] = {}  # waiting for free GPUs to measure on
        self._blocked: set[Key] = set()  # already logged as waiting for GPUs
        self.waiting: dict[str, ServiceRun] = {}  # runs in Profiling

    def wait_for(self, run: ServiceRun) -> None:
        request: Request = run.request
        if request.profile_key not in self._running:
            self._queued.setdefault(request.profile_key, request)
        self.waiting[run.run_id] = run

    def forget(self, run_id: str) -> None:
        self.waiting.pop(run_id, None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def poll(self, now: float, cluster: Cluster, max_job_gpus: int) -> tuple[list[Outcome], list[Event]]:
        """Start what can start on `cluster`: the runs whose wait is over, and
        the GPUs reserved or given back meanwhile (for the loop)."""
        reservations: list[Event] = [Unreserved(_name(key)) for key, future in self._running.items()
                                     if future.done()]  # done: its GPUs go back to the runs
        holders = self.holders(cluster, reserved=[e.holder for e in reservations])
        reservations += self._start(cluster, max_job_gpus, holders)
        out = []
        for run_id, run in list(self.waiting.items()):
            request: Request = run.request
            future = self._running.get(request.profile_key)
            if future is None and now - run.taken_in_at > self.timeout_s:
                # Never started: the GPUs stayed busy. A profile that started ends
                # by itself (it has the same timeout) and is reported below.
                del self.waiting[run_id]
                out.append(Outcome(run, None, RejectionReason.PROFILING_FAILED, (
                    f"no GPUs were free to profile {request.model} at global batch {request.batch_size} for "
                    f"{now - run.taken_in_at:.0f} s (held: {holders}); submit it again later, or measure "
                    "it first with `elasticflow profile`")))
                continue
            if future is None or not future.done():
                continue
            del self.waiting[run_id]
            try:
                points = usable_points(future.result(), request.batch_size, max_job_gpus)
            except Exception as exc:  # profiling is the user's model running: any error is theirs to see
                out.append(Outcome(run, None, RejectionReason.PROFILING_FAILED, f"{type(exc).__name__}: {exc}"))
                continue
            out.append(Outcome(run, points))
        needed = {run.request.profile_key for run in self.waiting.values()}
        for key in [k for k, f in self._running.items() if f.done() and k not in needed]:
            del self._running[key]
        for key in [k for k in self._queued if k not in needed]:  # its runs gave up waiting
            del self._queued[key]
        self._blocked &= set(self._queued)
        return out, reservations

    def _start(self, cluster: Cluster, max_job_gpus: int, holders: str) -> list[Event]:
        started: list[Event] = []
        taken: set[int] = set()  # reserved in this poll, before the loop hears of it
        for key, request in list(self._queued.items()):
            top = min(max_job_gpus, request.batch_size, 4 if self.device == "cpu" else max_job_gpus)
            gpus = cluster.free_block(top)
            if not gpus or taken & set(gpus):
                if key not in self._blocked:
                    self._blocked.add(key)
                    log.info("profiling %s@%s waits for free GPUs (held: %s)", key[0], key[1], holders)
                continue
            self._blocked.discard(key)
            del self._queued[key]
            taken |= set(gpus)
            started.append(Reserved(_name(key), gpus))
            log.info("%s on GPUs %s", _name(key), ",".join(map(str, gpus)))
            self._running[key] = self._pool.submit(self.measure, request, list(gpus))
        return started

    @staticmethod
    def holders(cluster: Cluster, reserved: Iterable[str] = ()) -> str:
        """Who holds which GPU, for messages about GPUs that are not free
        (`reserved`: holders giving theirs back now)."""
        held = {gpu: holder for gpu, holder in cluster.gpu_map().items()
                if holder.removeprefix("service:") not in reserved}
        return ", ".join(f"{gpu}: {holder}" for gpu, holder in sorted(held.items())) or "none"

    def sizes(self) -> dict[str, int]:
        return {"waiting": len(self.waiting), "running": len(self._running), "queued": len(self._queued),
                "blocked": len(self._blocked)}


def measure_where_runs_train(device: str, iterations: int, timeout_s: float, cluster: Callable[[], Any],
                             ray_address: str | None) -> Measure:
    """The real measurement: DDP ranks of the user's model on the given GPUs,
    where a run on them would train (processes here, or Ray actors on the
    nodes of a Ray cluster: `cluster()` says where each GPU is), saved to the
    store for the next run of the same model and batch. On a cluster of
    several kinds the curve is kept as the kind's it was measured on, and as
    the stand-in for kinds not measured yet (intake.kind_curves)."""
    def measure(request: Request, gpus: list[int]) -> dict[int, float]:
        from flows.training.profiler import profile_throughput
        from scheduler_service.policy.topology import kind_of
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
        save_curve(params.model, request.batch_size, curve, device=device)
        kind = kind_of(now.topology, gpus[0])
        if kind:
            save_curve(params.model, request.batch_size, curve, device=device, kind=kind)
        log.info("profiled %s@%s on %s%s: %s", params.model, request.batch_size,
                 ", ".join(now.nodes_of(gpus)), f" ({kind})" if kind else "",
                 ", ".join(f"{g} GPU(s) {r:.2f} it/s" for g, r in sorted(curve.items())))
        return curve

    return measure
