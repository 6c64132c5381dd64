"""Where a run's ranks run: the seam between the scheduler and the machines.

The worker decides *which* GPUs; an execution backend makes a run's ranks
start there, says whether they are up, and stops them. Everything the worker
knows about processes, PIDs, hosts and addresses lives behind this protocol.

`LocalProcesses` is the embedded default: the flow process that Prefect's
process worker starts on this machine forks the run's DDP ranks itself (warm,
from the fork server) and binds them to loopback; it is stopped through
`cancellation.Cancellations` (control channel, then SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from scheduler_service.worker.cluster import Cluster
from scheduler_service.worker.cancellation import Cancellations, Step, Stop, is_flow_process, process_id

log = logging.getLogger("prefect.workers.elasticflow.backend")  # shown with the worker's own lines


@dataclass(frozen=True, slots=True)
class Placement:
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

    def prepare(self, env: dict[str, str], placement: Placement) -> None:
        """Start this run's ranks on these GPUs: fill in the environment of the
        flow process Prefect's worker starts (it launches the ranks)."""

    def infrastructure_id(self, pid: int) -> str:
        """Where the run lives, as Prefect records it (`host:pid`)."""

    def alive(self, infrastructure_id: str | None, run_id: str) -> bool:
        """Whether the run's processes are still there (and still that run's)."""

    def stop_step(self, run_id: str, infrastructure_id: str | None, message: str | None, now: float,
                  adopted: bool) -> Step | None:
        """The next step in stopping a cancelled run that Prefect cannot stop."""

    def forget(self, run_id: str) -> Stop | None:
        """The run's processes are gone: what was done to stop them, if anything."""

    def kill(self, infrastructure_id: str, run_id: str | None, grace_s: float) -> None:
        """Stop the run's processes now (SIGTERM, SIGKILL after `grace_s`)."""


class LocalProcesses:
    """Runs on this machine: flow processes started by Prefect's process
    worker, warm-started from the fork server unless `warm_start` is off."""

    name = "local"

    def __init__(self, warm_start: bool = True) -> None:
        self.warm_start = warm_start
        self.host = socket.gethostname()
        self.stops = Cancellations()
        self._forkserver: tuple[subprocess.Popen[bytes], Path] | None = None

    def open(self, home: Path) -> None:
        from flows.training.forkserver import launch

        if not self.warm_start:
            return
        process, path = launch(home)
        self._forkserver = process, path
        log.info("warm start: fork server pid %d at %s (log %s)", process.pid, path, home / "logs" / "forkserver.log")

    def cluster(self) -> Cluster | None:
        return None

    def changed(self, now: float) -> Cluster | None:
        return None

    def close(self) -> None:
        if self._forkserver is not None:  # it stops taking runs; the running ones keep their relay
            self._forkserver[0].terminate()

    def prepare(self, env: dict[str, str], placement: Placement) -> None:
        from flows.training.boot import FORKSERVER_ENV
        from flows.training.standby import is_secret

        # Prefect hands the flow process the worker's whole environment: not its
        # store's credentials (the flow talks to Prefect, whose own settings stay).
        for name in [n for n in env if is_secret(n) and not n.startswith("PREFECT_")]:
            del env[name]
        env.update({
            "ELASTICFLOW_GPUS": ",".join(map(str, placement.gpus)),
            "ELASTICFLOW_WORLD_SIZE": str(len(placement.gpus)),
            "ELASTICFLOW_NODES": ",".join(placement.nodes),
        })
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

    def alive(self, infrastructure_id: str | None, run_id: str) -> bool:
        pid = self._local_pid(infrastructure_id)
        return pid is not None and is_flow_process(pid, run_id)

    def stop_step(self, run_id: str, infrastructure_id: str | None, message: str | None, now: float,
                  adopted: bool) -> Step | None:
        return self.stops.step(run_id, self._local_pid(infrastructure_id), message, now, adopted)

    def forget(self, run_id: str) -> Stop | None:
        return self.stops.forget(run_id)

    def kill(self, infrastructure_id: str, run_id: str | None, grace_s: float) -> None:
        """SIGTERM now (its ranks checkpoint on the way out), SIGKILL after
        `grace_s` if it is still there; only a process that is still that
        run's is signalled."""
        import time

        pid = self._local_pid(infrastructure_id)
        if pid is None or (run_id is not None and not is_flow_process(pid, run_id)):
            raise InfrastructureGone(infrastructure_id)

        def there() -> bool:  # a reaped or reused PID is not that run any more
            return is_flow_process(pid, run_id) if run_id is not None else _exists(pid)

        _send(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if not there():
                return
            time.sleep(0.2)
        if there():
            _send(pid, signal.SIGKILL)

    def _local_pid(self, infrastructure_id: str | None) -> int | None:
        """The PID in `host:pid` when the host is this one (a bare PID is ours)."""
        if not infrastructure_id:
            return None
        host, sep, _ = str(infrastructure_id).rpartition(":")
        if sep and host and host != self.host:
            return None
        return process_id(infrastructure_id)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def _send(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except OSError:
        pass


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
