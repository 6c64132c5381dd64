"""Adoption after a restart, without a server: a stored run comes back on the
GPUs its control channel says it may be using, and runs that ended while no
worker watched are closed in the store."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from flows.training.control import ControlAck, FileControlChannel
from scheduler_service.worker.recovery import Found, adopted_run
from scheduler_service.worker.store import RunRecord

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc).timestamp()


def _row() -> RunRecord:
    return RunRecord(flow_run_id="r1", flow_run_name="calm-otter", model="mlp", global_batch_size=32,
                     iterations=1000, deadline=datetime(2026, 12, 1, 13, 0), status="running", share=1,
                     submitted_at=datetime(2026, 12, 1, 11, 59))  # naive, as SQLite hands it back


def test_a_running_run_is_adopted_on_every_gpu_it_may_be_using(tmp_path: Path) -> None:
    channel = FileControlChannel("r1", tmp_path)
    first = channel.request("rescale", [0, 1])
    channel.acknowledge(ControlAck(seq=first.seq, iteration=10, gpus=[0, 1]))
    second = channel.request("rescale", [0])  # told to shrink, not acknowledged yet: still on both
    found = Found(final=False, running=True, cancelling=False, scheduled=False)
    run, adopted = adopted_run(_row(), found, str(tmp_path), {1: 10.0, 2: 19.0}, max_job_gpus=2, now=NOW)
    assert adopted.running and run.foreign_process and adopted.last_seq == second.seq
    assert adopted.held == (0, 1) and adopted.commanded == (0,) and adopted.pending_seq == second.seq
    assert run.deadline == datetime(2026, 12, 1, 13, 0, tzinfo=timezone.utc).timestamp()  # read as UTC
    assert adopted.job.deadline == run.deadline and adopted.job.curve.levels == (1, 2) and run.name == "calm-otter"


def test_an_admitted_run_still_waiting_is_adopted_holding_nothing(tmp_path: Path) -> None:
    found = Found(final=False, running=False, cancelling=False, scheduled=True)
    run, adopted = adopted_run(_row(), found, str(tmp_path), {1: 10.0}, max_job_gpus=2, now=NOW)
    assert not adopted.running and adopted.held == () and not run.foreign_process
