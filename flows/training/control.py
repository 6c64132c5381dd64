"""The narrow channel through which the scheduler steers a running training flow.

The scheduler writes a command; the running segment's rank-0 worker polls it at
every iteration boundary, stops, checkpoints and exits; the flow reads the
command, relaunches on the new GPU set and acknowledges. No database or API
credentials are involved: the channel is a folder both sides can reach.

    ROOT/RUN_KEY/command.json   latest command, written by the scheduler (seq increases)
    ROOT/RUN_KEY/ack.json       last command applied, written by the flow
    ROOT/RUN_KEY/status.json    latest progress, written by the flow

Writes are atomic (temp file + rename), so a reader never sees half a file.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class GpuSlot(BaseModel):
    """Where one GPU of a placement is, on a cluster of several machines: the
    Ray node and the device index on it. A GPU id alone is a position in the
    service's current topology, which changes when nodes come and go."""

    model_config = ConfigDict(frozen=True)

    node: str = Field(description="Ray node id")
    name: str = Field(description="the node's name, for people")
    ip: str = Field(description="the node's address: the rendezvous of a run whose rank 0 is here")
    index: int = Field(ge=0, description="CUDA device index on the node (a worker slot on a CPU-only node)")


class ControlCommand(BaseModel):
    """`rescale` moves the run to `gpus` (an empty list parks it until the next
    rescale); `stop` checkpoints and ends the flow run. On a cluster,
    `placement` says where each of `gpus` is, in the same order."""

    seq: int = Field(ge=1)
    action: Literal["rescale", "stop"]
    gpus: list[int] | None = None
    placement: list[GpuSlot] | None = None
    issued_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))


class RunStatus(BaseModel):
    """`status.json`: what the run's rank 0 last reported, for the UI and the
    scheduler. Extra keys (an event's details) are kept."""

    model_config = ConfigDict(extra="allow")

    run_key: str = ""
    iteration: int = 0
    total_iterations: int = 0
    loss: float | None = None
    gpus: list[int] = Field(default_factory=list)
    iterations_per_s: float | None = None
    projected_finish: datetime | None = None
    deadline: datetime | None = None
    on_track: bool | None = None
    event: str | None = None
    save_error: str | None = Field(None, description="why checkpoint saves fail, while they do")

    @property
    def percent(self) -> float:
        return 100.0 * self.iteration / max(1, self.total_iterations)


class ControlAck(BaseModel):
    seq: int
    iteration: int
    gpus: list[int]
    placement: list[GpuSlot] | None = Field(None, description="where `gpus` are, as the command said (a cluster)")
    applied_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))


class ControlChannel(Protocol):
    """What the scheduler and the flow need from a channel; swap the transport freely."""

    def request(self, action: Literal["rescale", "stop"], gpus: list[int] | None = None,
                placement: list[GpuSlot] | None = None) -> ControlCommand: ...

    def pending(self, applied_seq: int) -> ControlCommand | None: ...

    def acknowledge(self, ack: ControlAck) -> None: ...


def default_control_root() -> Path:
    from elasticflow_block.home import elasticflow_home

    return elasticflow_home() / "control"


def write_json_atomic(path: Path, text: str) -> None:
    """Readers see the old file or the new one, never half of one. In a folder
    shared with a run's ranks (setgid, `identity.RankIdentity.share`) the file
    is readable by their group, as the command they poll must be."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    if path.parent.stat().st_mode & stat.S_ISGID:
        os.chmod(tmp, 0o640)
    os.replace(tmp, path)


class FileControlChannel:
    """`ControlChannel` over files in a folder keyed by run (flow run id)."""

    def __init__(self, run_key: str, root: str | Path | None = None) -> None:
        self.run_key = run_key
        self.folder = Path(root or default_control_root()) / run_key
        self.command_path = self.folder / "command.json"
        self.ack_path = self.folder / "ack.json"
        self.status_path = self.folder / "status.json"

    def latest(self) -> ControlCommand | None:
        try:
            return ControlCommand.model_validate_json(self.command_path.read_text())
        except FileNotFoundError:
            return None

    def request(self, action: Literal["rescale", "stop"], gpus: list[int] | None = None,
                placement: list[GpuSlot] | None = None) -> ControlCommand:
        """Scheduler side: issue a command; it supersedes any not yet applied."""
        if action == "rescale" and gpus is None:
            raise ValueError("rescale needs a GPU list (empty to park the run)")
        if placement is not None and len(placement) != len(gpus or []):
            raise ValueError("a placement names one slot for each GPU")
        current = self.latest()
        command = ControlCommand(seq=(current.seq if current else 0) + 1, action=action, gpus=gpus,
                                 placement=placement)
        write_json_atomic(self.command_path, command.model_dump_json())
        return command

    def pending(self, applied_seq: int) -> ControlCommand | None:
        """Flow/worker side: the newest command not yet applied, if any."""
        command = self.latest()
        return command if command and command.seq > applied_seq else None

    def acknowledge(self, ack: ControlAck) -> None:
        write_json_atomic(self.ack_path, ack.model_dump_json())

    def acknowledged(self) -> ControlAck | None:
        try:
            return ControlAck.model_validate_json(self.ack_path.read_text())
        except FileNotFoundError:
            return None

    def publish_status(self, status: dict[str, object]) -> None:
        write_json_atomic(self.status_path, json.dumps(status, default=str))

    def status(self) -> RunStatus | None:
        """The last status the run wrote; None before its first (or if unreadable)."""
        try:
            return RunStatus.model_validate_json(self.status_path.read_text())
        except (FileNotFoundError, ValidationError):
            return None
