"""A store and control folder holding runs in every phase, written through the
worker's own classes (ServiceStore, FileControlChannel), for `elasticflow
status`'s test and benchmark (bench/service.py --status-only)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

from flows.training.control import FileControlChannel
from scheduler_service.contracts import AllocationAction, RunPhase
from scheduler_service.store.db import get_engine
from scheduler_service.worker.cluster import load
from scheduler_service.worker.store import AllocationRecord, DecisionRecord, ServiceStore

CLUSTER = Path(__file__).resolve().parents[2] / "data" / "clusters" / "n16g4.csv"  # 64 GPUs, 4 a node
KINDS = ("profiling", "waiting", "parked", "running", "rescaling", "met", "missed", "stopped", "rejected", "failed")
TOTAL = 500
REJECTION = ("infeasible_even_on_an_idle_cluster", "even the whole cluster cannot finish 500 iterations by then")


def fill(home: Path, runs: int = 100) -> dict[str, str]:
    """`runs` runs cycling through KINDS, GPUs given in turn, on CLUSTER as a
    worker publishes it; returns name -> kind."""
    load(CLUSTER).publish(home)
    store = ServiceStore(get_engine(f"sqlite:///{home / 'elasticflow.db'}"))
    now = datetime.now(timezone.utc)
    kinds, next_gpu = {}, 0
    for i in range(runs):
        kind, run_id, name = KINDS[i % len(KINDS)], f"00000000-0000-0000-0000-{i:012d}", f"run-{i:03d}"
        kinds[name] = kind
        deadline = now + timedelta(minutes=30)
        store.upsert_job(run_id, flow_run_name=name, model="mlp", iterations=TOTAL, deadline=deadline,
                         submitted_at=now - timedelta(minutes=60 - i * 0.1), phase=RunPhase.ARRIVED)
        channel = FileControlChannel(run_id, home / "control")
        if kind == "profiling":  # as the worker writes it while it measures the model
            store.upsert_job(run_id, RunPhase.PROFILING, message="profiling the throughput of this model on first use")
            continue
        if kind == "rejected":
            store.add(DecisionRecord(flow_run_id=run_id, admitted=False, reason=REJECTION[0], message=REJECTION[1],
                                     earliest_feasible_deadline=now + timedelta(hours=3)))
            store.upsert_job(run_id, RunPhase.REJECTED, message=f"{REJECTION[0]}: {REJECTION[1]}")
            continue
        store.add(DecisionRecord(flow_run_id=run_id, admitted=True, share=1, message="admitted with 1 GPU"))
        store.upsert_job(run_id, RunPhase.ADMITTED, share=1, message="admitted with 1 GPU")
        if kind == "waiting":
            continue
        gpu = next_gpu = next_gpu + 1 if kind in ("running", "rescaling") else next_gpu
        gpus = str(gpu - 1)
        store.add(AllocationRecord(flow_run_id=run_id, action=AllocationAction.LAUNCH.value, gpus=gpus))
        store.upsert_job(run_id, RunPhase.RUNNING, gpus=gpus)
        done = TOTAL if kind in ("met", "missed", "failed") else 200  # failed: at its last save
        channel.publish_status({"run_key": run_id, "iteration": done, "total_iterations": TOTAL,
                                "gpus": [gpu - 1], "iterations_per_s": 20.0, "deadline": deadline.isoformat(),
                                "projected_finish": (now + timedelta(minutes=10)).isoformat(), "event": "progress"})
        if kind == "parked":
            store.add(AllocationRecord(flow_run_id=run_id, action=AllocationAction.PARK.value, gpus=""))
            store.add(AllocationRecord(flow_run_id=run_id, action=AllocationAction.RELEASED.value, gpus=""))
            store.upsert_job(run_id, gpus="")
        elif kind == "rescaling":
            channel.request("rescale", [gpu - 1, 63])
        elif kind in ("met", "missed", "stopped", "failed"):
            ended = deadline + timedelta(minutes=5) if kind == "missed" else now - timedelta(minutes=1)
            store.add(AllocationRecord(flow_run_id=run_id, action=AllocationAction.RELEASE.value, gpus="", at=ended))
            store.upsert_job(run_id, RunPhase.FINISHED, gpus="")
            store.upsert_job(run_id, outcome=kind)  # as the worker records it, from the final state
    return kinds
