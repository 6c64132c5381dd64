"""Throughput profiling: iterations/s of a model at one global batch size on
1, 2, 4, ... GPUs, measured with short real DDP runs of the training runtime.

The first `warmup` iterations of each run are excluded (allocator warm-up,
dynamo import on the first optimizer step), so the figure is the steady rate
that admission should plan with. The ranks run where a run's would (ranks.py):
processes here, or Ray actors on the slots a placement names, so a service on
a Ray cluster measures a model on the nodes it will train on.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from elasticflow_block.home import elasticflow_home
from flows.training.launch import identity
from flows.training.control import FileControlChannel, GpuSlot
from flows.training.params import Hyperparameters, TrainParameters
from flows.training.coordinator.ranks import LocalRanks, ranks_for
from flows.training.coordinator.runtime import default_device
from flows.training.segment import SegmentResult, SegmentSpec
from flows.training.supervision import RunningSegment

log = logging.getLogger("elasticflow.profile")


def steady_rate(result: SegmentResult, warmup: int) -> float:
    """Iterations/s between the end of iteration `warmup` and the last one."""
    ends = sorted(result.timings.iteration_end_t.items())
    if len(ends) <= warmup + 1:
        raise ValueError(f"need more than {warmup + 1} iterations to measure a rate, got {len(ends)}")
    (i0, t0), (i1, t1) = ends[warmup], ends[-1]
    return (i1 - i0) / max(t1 - t0, 1e-9)


def profile_throughput(
    model: str,
    batch_size: int,
    gpu_counts: list[int],
    iterations: int = 10,
    warmup: int = 2,
    device: str = "auto",
    model_kwargs: dict[str, Any] | None = None,
    dataset: str | dict[str, Any] | None = None,
    gpu_ids: list[int] | None = None,
    timeout_s: float | None = None,
    ray_address: str | None = None,
    placement: list[GpuSlot] | None = None,
    segment_hook: Callable[[RunningSegment], None] | None = None,
) -> dict[int, float]:
    """GPU count -> measured iterations/s. Checkpoints go to a temporary folder.

    `gpu_ids`: the devices to measure on (the first `count` of them for each
    count), so a service can profile on GPUs nobody else is using; default
    0, 1, 2... `timeout_s`: for all counts together; past it the measurement
    is stopped and RuntimeError says so, with the ranks' logs, so a service
    never waits on a hung profile with GPUs reserved for it. `ray_address`
    and `placement` (one slot per GPU id): on those slots of a Ray cluster,
    as Ray actors. `segment_hook` sees each segment once it runs (a test
    asks where its ranks are)."""
    bad = [g for g in gpu_counts if g < 1 or g & (g - 1)]
    if bad:
        raise ValueError(f"GPU counts must be powers of two, got {bad}")
    ids = list(gpu_ids) if gpu_ids is not None else list(range(max(gpu_counts)))
    if len(ids) < max(gpu_counts):
        raise ValueError(f"{max(gpu_counts)} GPUs to measure, only {len(ids)} given: {ids}")
    if placement is not None and len(placement) != len(ids):
        raise ValueError(f"a placement names {len(placement)} slots for {len(ids)} GPUs")
    if iterations <= warmup + 1:
        raise ValueError("iterations must exceed warmup + 1")
    # The worker profiles in its own process: a model given by import path is
    # imported by the ranks (the run's own processes) only, never here, where
    # its import code would run beside every secret of the stack.
    params = TrainParameters.model_validate(dict(
        model=model,
        model_kwargs=model_kwargs or {},
        dataset=dataset,
        hyperparameters=Hyperparameters(global_batch_size=batch_size),
        iterations=iterations,
        gpu_plan=[ids[: max(gpu_counts)]],
        device=device,
    ), context={"import_models": False})
    give_up = None if timeout_s is None else time.time() + timeout_s
    scratch = tempfile.mkdtemp(prefix="elasticflow-profile-")
    home = elasticflow_home()
    key = f"profile-{uuid.uuid4().hex[:12]}"
    account = identity.identity_for(key, home)  # a profile runs user code too
    if account is not None:
        account.share(Path(scratch))
    # Ray actors write nothing here (no checkpoint, progress by Ray): no control folder is made for them.
    ranks = (ranks_for(ray_address, key, FileControlChannel(key, Path(scratch))) if ray_address
             else LocalRanks(Path(scratch), identity=account))
    curve: dict[int, float] = {}
    try:
        for count in sorted(set(gpu_counts)):
            spec = SegmentSpec.of_run(
                params,
                run_key=f"{key}-{count}",
                total_iterations=iterations,
                stop_at=iterations,
                checkpoint_interval=iterations + 1,
                checkpoint_url=scratch,
                device=default_device(device),
                save_at_end=False,
            )
            for attempt in (1, 2):  # a worker process can fail to start its part: once more, fresh
                left = None if give_up is None else max(0.0, give_up - time.time())
                result = _measure(ranks.segment(spec, ids[:count], placement[:count] if placement else None), left,
                                  segment_hook)
                if result.reason != "crashed" or attempt == 2 or (give_up is not None and time.time() >= give_up):
                    break
                log.warning("profiling model=%s gpus=%d crashed, retrying: %s", model, count, result.error)
            if result.reason == "crashed":
                raise RuntimeError(f"profiling {model} on {count} GPUs failed: {result.error}")
            curve[count] = steady_rate(result, warmup)
            log.info("profiled model=%s batch=%d gpus=%d it_per_s=%.3f", model, batch_size, count, curve[count])
    finally:
        ranks.close()
        shutil.rmtree(scratch, ignore_errors=True)
        if account is not None:
            account.release(home)
    return curve


def _measure(segment: RunningSegment, timeout_s: float | None,
             hook: Callable[[RunningSegment], None] | None) -> SegmentResult:
    segment.start()
    try:
        if hook is not None:
            hook(segment)
        return segment.wait(timeout_s=timeout_s)
    except BaseException:
        segment.kill(grace_s=2.0)
        raise
