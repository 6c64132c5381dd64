"""The worker without a Prefect server, for tests of its own logic: the
store is a real SQLite database, Prefect's API a recorder of what would have
been sent (what reaches Prefect is tested against a real server elsewhere)."""

from __future__ import annotations

import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy.pool import StaticPool
from sqlmodel import create_engine

from scheduler_service.worker.publish import Publisher
from scheduler_service.worker.store import ServiceStore

ROOT = Path(__file__).parents[2]


class RecordingPublisher(Publisher):
    """Counts what would go to Prefect and which runs were told what; keeps nothing else."""

    def __init__(self, keep_states: bool = True) -> None:
        super().__init__(client=None, related=list)
        self.calls = 0
        self.keep_states = keep_states
        self.states: dict[str, str] = {}  # run id -> last state name it would have been given
        self.named: dict[str, list[str]] = {}  # run id -> every state name it would have been given

    def event(self, *args: Any, **kwargs: Any) -> None:
        self.calls += 1

    async def labels(self, *args: Any) -> None:
        self.calls += 1

    async def waiting_state(self, run: Any, name: Any, *args: Any) -> None:
        self.calls += 1
        if self.keep_states:
            self.states[run.run_id] = name.value
            self.named.setdefault(run.run_id, []).append(name.value)

    async def rejected(self, run_id: str, rejection: Any) -> None:
        self.calls += 1
        if self.keep_states:
            self.states[run_id] = "Rejected"

    async def history(self, run: Any, *args: Any, **kwargs: Any) -> None:
        self.calls += 1  # its rows are kept on the run: gone with it


class OfflineClient:
    """What take-in asks Prefect: every run here is of the `train` flow, and
    the only saved blocks are those in `blocks`."""

    def __init__(self, blocks: tuple[str, ...] = (), deployments: dict[Any, dict[str, Any]] | None = None) -> None:
        self.blocks = blocks
        self.deployments = deployments or {}  # deployment id -> its job variables
        self.renamed: dict[str, str | None] = {}  # flow run id -> the name it was given

    async def update_flow_run(self, flow_run_id: Any, name: str | None = None) -> None:
        self.renamed[str(flow_run_id)] = name

    async def read_deployment(self, deployment_id: Any) -> Any:
        return SimpleNamespace(id=deployment_id, job_variables=self.deployments[deployment_id])

    async def read_flow(self, flow_id: Any) -> Any:
        return SimpleNamespace(name="train")

    async def read_block_document_by_name(self, name: str, block_type_slug: str) -> Any:
        from prefect.exceptions import ObjectNotFound

        if name not in self.blocks:
            raise ObjectNotFound(http_exc=Exception(f"{block_type_slug}/{name}"))
        return SimpleNamespace(name=name)


class FlowRun:
    """What the worker reads of a Prefect flow run at take-in."""

    def __init__(self, parameters: dict[str, Any] | None = None, run_id: str | None = None,
                 job_variables: dict[str, Any] | None = None, deployment_id: Any = None) -> None:
        self.id = run_id or str(uuid.uuid4())
        self.name = f"run-{self.id[:8]}"
        self.parameters = parameters or {}
        self.job_variables = job_variables or {}
        self.deployment_id = deployment_id
        self.flow_id = "train"
        self.next_scheduled_start_time = self.expected_start_time = None  # due now


class Entry:
    """A scheduled run as a poll returns it."""

    def __init__(self, flow_run: FlowRun) -> None:
        self.flow_run = flow_run


def offline_worker(home: Path, monkeypatch: pytest.MonkeyPatch, publisher: RecordingPublisher | None = None,
                   store: ServiceStore | None = None) -> Any:
    """A worker with no Prefect: a recording publisher, an offline client, and
    an in-memory store unless `store` is given (one that outlives it)."""
    from scheduler_service.worker.worker import ElasticFlowWorker

    monkeypatch.setenv("ELASTICFLOW_HOME", str(home))
    monkeypatch.setenv("ELASTICFLOW_CLUSTER", str(ROOT / "infra" / "local-cpu2.csv"))
    worker = ElasticFlowWorker(work_pool_name="offline")
    worker.get_flow_run_logger = lambda flow_run: worker._logger  # type: ignore[method-assign]
    worker.connect(store or ServiceStore(create_engine("sqlite://", poolclass=StaticPool,
                                                       connect_args={"check_same_thread": False})),
                   publisher or RecordingPublisher(), OfflineClient())
    return worker
