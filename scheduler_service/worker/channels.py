"""The control loop's commands to a run, and what the run says back, over
its file control channel (flows/training/control.py): the one place the
service reads or writes a run's channel."""

from __future__ import annotations

from flows.training.control import ControlCommand, FileControlChannel, GpuSlot, write_json_atomic
from scheduler_service.loop.actions import Command
from scheduler_service.loop.events import Acknowledged, Event, Progress


def send(channel: FileControlChannel, command: Command, placement: list[GpuSlot] | None) -> None:
    """Write the loop's command, numbered as the loop numbered it: the run
    applies the newest command it has not applied, and acknowledges its seq."""
    rescale = command.channel_action == "rescale"
    message = ControlCommand(seq=command.seq, action=command.channel_action,  # type: ignore[arg-type]
                             gpus=list(command.gpus) if rescale else None,
                             placement=placement if rescale and command.gpus else None)
    write_json_atomic(channel.command_path, message.model_dump_json())


def observe(run_id: str, channel: FileControlChannel) -> list[Event]:
    """What a launched run last said: its acknowledgement and its progress."""
    events: list[Event] = []
    ack = channel.acknowledged()
    if ack is not None:
        events.append(Acknowledged(run_id, ack.seq, tuple(ack.gpus)))
    status = channel.status()
    if status is not None:
        projected = status.projected_finish.timestamp() if status.projected_finish is not None else None
        events.append(Progress(run_id, status.iteration, tuple(status.gpus), status.iterations_per_s, projected,
                               status.save_error))
    return events


def trained_at(channel: FileControlChannel, iterations: int) -> float | None:
    """When rank 0 reported the whole run trained, if it did: its last status
    says `completed` at the last iteration, written once its ranks saved and
    closed. A deadline is judged by that moment: what the flow process tells
    Prefect afterwards is bookkeeping, which a slow server once stretched by
    a minute (a run trained 56 s before its deadline was counted late)."""
    status = channel.status()
    if status is None or status.event != "completed" or status.iteration < iterations:
        return None
    try:
        return channel.status_path.stat().st_mtime
    except OSError:
        return None
