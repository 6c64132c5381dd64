"""Where a run's ranks run: the seam between the scheduler and the machines.

The worker decides *which* GPUs; an execution backend makes a run's ranks
start there, says whether they are up, and stops them. Everything the worker
knows about processes, PIDs, hosts and addresses lives behind this protocol.

Every backend has a coordinating flow process per run on this machine, which
Prefect's process worker starts: `FlowProcesses` is that part, written once
(its environment and launch, its infrastructure id, whether it is alive, and
stopping it: `cancellation.Escalation`). A backend composes it with where the
ranks go: `LocalProcesses`, the embedded default, lets the flow process fork
the run's DDP ranks itself (warm, from the fork server) on loopback;
`ray_backend.RayBackend` puts them on a Ray cluster's nodes.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from flows.training.launch.spec import LaunchSpec
from scheduler_service.worker.cancellation import (
    Cancellations,
    Escalation,
    Cancelling,
    StopStep,
    is_flow_process,
    process_id,
)
from scheduler_service.worker.cluster import Cluster

log = logging.getLogger("prefect.workers.elasticflow.backend")  # shown with the worker's own lines


@dataclass(frozen=True, slots=True)
class RankPlacement:
    """A run's ranks, one per GPU, and the nodes those GPUs are on."""

    run_id: str
    gpus: tuple[int, ...]
    nodes: tuple[str, ...]


class InfrastructureGone(LookupError):
    """The run's processes are not (or no longer) where its id says."""


class ExecutionBackend(Protocol):
    name: str

    def open(self, home: Path) -> None:
        """Start what makes launches fast (a warm-start server); called once."""

    def cluster(self) -> Cluster | None:
        """The cluster as the backend sees it (None: the operator's cluster file, or this machine)."""

    def changed(self, now: float) -> Cluster | None:
        """The cluster, if nodes joined or left since the last look."""

    def close(self) -> None:
        """Stop taking launches; running runs keep going."""

    def prepare(self, env: dict[str, str], placement: RankPlacement, spec: LaunchSpec) -> None:
        """Start this run's ranks on these GPUs: fill in the environment of the
        flow process Prefect's worker starts (it launches the ranks), with
        `spec` completed (placement, standby ranks, where the ranks run)."""

    def infrastructure_id(self, pid: int) -> str:
        """Where the run lives, as Prefect records it (ending in `host:pid`)."""

    def alive(self, infrastructure_id: str | None, run_id: str) -> bool:
        """Whether the run's processes are still there (and still that run's)."""

    def stop_step(self, run_id: str, infrastructure_id: str | None, message: str | None, now: float,
                  adopted: bool) -> StopStep | None:
        """The next step in stopping a cancelled run that Prefect cannot stop."""

    def forget(self, run_id: str) -> Cancelling | None:
        """The run's processes are gone: what was done to stop them, if anything."""

    def kill(self, infrastructure_id: str, run_id: str | None, grace_s: float) -> None:
        """Stop the run's processes now (SIGTERM, SIGKILL after `grace_s`)."""


class FlowProcesses:
    """The coordinating flow process of each run, on this machine: started by
    Prefect's process worker (forked warm from the fork server unless
    `warm_start` is off), named `host:pid`, stopped by one `Escalation`."""

    def __init__(self, warm_start: bool = True) -> None:
        self.warm_start = warm_start
        self.host = socket.gethostname()
        self.stops = Cancellations()
        self._forkserver: tuple[subprocess.Popen[bytes], Path] | None = None

    def open(self, home: Path) -> None:
        from flows.training.launch.forkserver import launch

        if not self.warm_start:
            return
        from flows.training.launch.boot import FORKSERVER_ENV

        process, path = launch(home)
        self._forkserver = process, path
        # The worker's own ranks (a model's profile) are forked there too: started cold, each of the
        # three of a 2-GPU profile spent ~3 s of CPU importing torch before the profile could start.
        os.environ[FORKSERVER_ENV] = str(path)
        log.info("warm start: fork server pid %d at %s (log %s)", process.pid, path, home / "logs" / "forkserver.log")

    def close(self) -> None:
        from flows.training.launch.boot import FORKSERVER_ENV

        if self._forkserver is not None:  # it stops taking runs; the running ones keep their relay
            self._forkserver[0].terminate()
            if os.environ.get(FORKSERVER_ENV) == str(self._forkserver[1]):
                del os.environ[FORKSERVER_ENV]

    def prepare(self, env: dict[str, str], placement: RankPlacement, spec: LaunchSpec) -> None:
        """The flow process's environment: the launch, with the placement; no
        secret of the worker's; the fork server, unless the run starts cold."""
        from flows.training.launch.boot import FORKSERVER_ENV
        from flows.training.launch.standby import is_secret

        # Prefect hands the flow process the worker's whole environment: not its
        # store's credentials (the flow talks to Prefect, whose own settings stay).
        for name in [n for n in env if is_secret(n) and not n.startswith("PREFECT_")]:
            del env[name]
        env.update(spec.model_copy(update={"gpus": list(placement.gpus), "nodes": list(placement.nodes)}).to_env())
        env.pop(FORKSERVER_ENV, None)  # the worker's own (its profiles'): a run is told below, or starts cold
        if self._forkserver is None:
            return
        # A forked process keeps what its interpreter read at start (sys.path,
        # TMPDIR, thread counts...) from the worker's environment; a run whose
        # job variables change any of it starts cold. Prefect settings are
        # compared by the server itself.
        own = sorted(k for k, v in env.items() if not k.startswith(("PREFECT_", "ELASTICFLOW_"))
                     and os.environ.get(k) != v)
        if own:
            log.info("flow run %s starts cold: its job variables set %s", placement.run_id, ", ".join(own))
        else:
            env[FORKSERVER_ENV] = str(self._forkserver[1])

    def infrastructure_id(self, pid: int) -> str:
        return f"{self.host}:{pid}"

    def pid_of(self, infrastructure_id: str | None) -> int | None:
        """The PID in an id ending in `host:pid` (a backend may put more before
        a `|`) when the host is this one; a bare PID is ours."""
        if not infrastructure_id:
            return None
        local = str(infrastructure_id).rsplit("|", 1)[-1]
        host, sep, _ = local.rpartition(":")
        if sep and host and host != self.host:
            return None
        return process_id(local)

    def alive(self, infrastructure_id: str | None, run_id: str) -> bool:
        pid = self.pid_of(infrastructure_id)
        return pid is not None and is_flow_process(pid, run_id)

    def stop_step(self, run_id: str, infrastructure_id: str | None, message: str | None, now: float,
                  adopted: bool) -> StopStep | None:
        return self.stops.step(run_id, self.pid_of(infrastructure_id), message, now, adopted)

    def forget(self, run_id: str) -> Cancelling | None:
        return self.stops.forget(run_id)

    def kill(self, infrastructure_id: str, run_id: str | None, grace_s: float) -> None:
        """SIGTERM now (its ranks checkpoint on the way out), SIGKILL after
        `grace_s` if it is still there; only a process that is still that
        run's is signalled."""
        pid = self.pid_of(infrastructure_id)
        if pid is None or (run_id is not None and not is_flow_process(pid, run_id)):
            raise InfrastructureGone(infrastructure_id)
        if Escalation(pid, run_id, grace_s).run() is StopStep.KILLED:
            log.warning("flow run %s: process %d still there %.0f s after SIGTERM; killed", run_id, pid, grace_s)
        else:
            log.info("flow run %s: process %d ended on SIGTERM", run_id, pid)


class LocalProcesses:
    """Runs on this machine: the flow process forks its run's ranks itself, on loopback."""

    name = "local"

    def __init__(self, warm_start: bool = True) -> None:
        self.flows = FlowProcesses(warm_start)

    def open(self, home: Path) -> None:
        self.flows.open(home)

    def cluster(self) -> Cluster | None:
        return None

    def changed(self, now: float) -> Cluster | None:
        return None

    def close(self) -> None:
        self.flows.close()

    def prepare(self, env: dict[str, str], placement: RankPlacement, spec: LaunchSpec) -> None:
        """Its boot starts the first segment's ranks as standbys, one per GPU,
        and as many spares: once a segment trains, its runtime keeps that many
        waiting for a restart (`RunState`'s upcoming GPUs), and a spare forked
        at boot costs nothing where one started then imports torch beside the
        training (2-4 s of CPU each)."""
        self.flows.prepare(env, placement, spec.model_copy(update={"standby": 2 * len(placement.gpus)}))

    def infrastructure_id(self, pid: int) -> str:
        return self.flows.infrastructure_id(pid)

    def alive(self, infrastructure_id: str | None, run_id: str) -> bool:
        return self.flows.alive(infrastructure_id, run_id)

    def stop_step(self, run_id: str, infrastructure_id: str | None, message: str | None, now: float,
                  adopted: bool) -> StopStep | None:
        return self.flows.stop_step(run_id, infrastructure_id, message, now, adopted)

    def forget(self, run_id: str) -> Cancelling | None:
        return self.flows.forget(run_id)

    def kill(self, infrastructure_id: str, run_id: str | None, grace_s: float) -> None:
        self.flows.kill(infrastructure_id, run_id, grace_s)


class Identified:
    """Prefect records what its launcher's `started` is given as the run's
    infrastructure id; the backend says what that is (`host:pid` here)."""

    def __init__(self, outer: Any, backend: ExecutionBackend) -> None:
        self.outer, self.backend = outer, backend

    def started(self, value: Any = None) -> None:
        if self.outer is not None:
            self.outer.started(self.backend.infrastructure_id(value) if isinstance(value, int) and value else value)


def backend_for(settings: Any) -> ExecutionBackend:
    """Ray's nodes when the settings name a Ray cluster, else this machine."""
    if settings.ray_address:
        from scheduler_service.worker.ray_backend import RayBackend

        return RayBackend(settings.ray_address, warm_start=settings.warm_start)
    return LocalProcesses(warm_start=settings.warm_start)
