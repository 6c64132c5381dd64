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


def current_ids(gpus: list[int] | None, placement: list[GpuSlot] | None,
                slots: tuple[GpuSlot, ...]) -> tuple[int, ...]:
    """`gpus` of a command or an acknowledgement, as ids of the cluster now.
    An id is a position in the worker's topology: a node gone or joined
    moves it, and a restarted worker numbers a Ray cluster afresh; where each
    GPU is (Ray node, device) does not move. A GPU on a node gone is dropped
    (its ranks went with it). On one machine ids never move."""
    if not placement or not slots:
        return tuple(gpus or ())
    now = {(slot.node, slot.index): i for i, slot in enumerate(slots)}
    return tuple(sorted(now[(s.node, s.index)] for s in placement if (s.node, s.index) in now))


def observe(run_id: str, channel: FileControlChannel, slots: tuple[GpuSlot, ...] = ()) -> list[Event]:
    """What a launched run last said: its acknowledgement and its progress
    (GPU ids as the cluster numbers them now: `slots`)."""
    events: list[Event] = []
    ack = channel.acknowledged()
    if ack is not None:
        events.append(Acknowledged(run_id, ack.seq, current_ids(ack.gpus, ack.placement, slots)))
    status = channel.status()
    if status is not None:
        projected = status.projected_finish.timestamp() if status.projected_finish is not None else None
        # rank 0 reports the GPUs of the command it last applied: where the acknowledgement says they are
        where = ack.placement if ack is not None and ack.gpus == status.gpus else None
        events.append(Progress(run_id, status.iteration, current_ids(status.gpus, where, slots),
                               status.iterations_per_s, projected, status.save_error))
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
