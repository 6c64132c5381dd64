"""What each rank of a segment is told, written once for the local launcher
and the Ray one: a typed order (`RankOrder`), the environment torch and the
collectives read, built from it, and the rendezvous port.

The launchers differ only in where the ranks sit (`Seat`: a node, the network
interface the job uses there, a device index) and in how an order travels (a
JSON line on a standby's stdin; an argument of a Ray actor call).

Pydantic and the standard library only: the rank processes, the Ray actors
and the stack import it before anything heavy.
"""

from __future__ import annotations

import random
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from flows.training.launch.identity import RankIdentity


LOOPBACK = "127.0.0.1"
FIXED_PORTS_BELOW = 10000  # well-known and registered services mostly sit below this: not searched


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port free right now on `host`'s address (only there, never every
    interface): a rendezvous on rank 0's node, or a server of the local stack.

    Taken below the kernel's ephemeral range where there is room: a port the
    kernel hands out for port 0 is in that range, and so is the local port of
    every outgoing connection (a Prefect client's, another job's ranks'), so
    between this check and the bind that needs it one of those could take it
    (`Address already in use`: a run failed so on a busy CI machine)."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(64 if low - FIXED_PORTS_BELOW >= 1024 else 0):
        port = rng.randrange(FIXED_PORTS_BELOW, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768 where unknown)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


@dataclass(frozen=True, slots=True)
class Seat:
    """Where one rank runs: its node (ranks on one node count their local
    rank together), the interface its collectives bind to there, and its
    device on that node."""

    node: str
    interface: str
    device_index: int


class RankOrder(BaseModel):
    """One rank's part of a segment."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int = Field(ge=0)
    local_rank: int = Field(ge=0, description="among the segment's ranks on the same node")
    world_size: int = Field(ge=1)
    master_addr: str = Field(description="rank 0's address: the rendezvous store listens there only")
    master_port: int
    interface: str = Field(description="gloo's and NCCL's sockets bind here: the interface holding the node's address")
    device_index: int | None = Field(description="the CUDA device on the node; None on CPU (a worker slot)")
    launch_t: float = Field(description="when the segment was launched (time.time()), for its timings")
    gpus: list[int] = Field(description="the segment's GPU ids, for its result")

    def env(self) -> dict[str, str]:
        """The variables torch, gloo and NCCL read, applied before CUDA is touched."""
        return {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "GLOO_SOCKET_IFNAME": self.interface,
            "NCCL_SOCKET_IFNAME": self.interface,
            # One device per rank: a rank always uses cuda:0 of what it sees.
            "CUDA_VISIBLE_DEVICES": "" if self.device_index is None else str(self.device_index),
        }


def rank_orders(seats: list[Seat], master_addr: str, master_port: int, device: Literal["cpu", "cuda"],
                launch_t: float, gpus: list[int]) -> list[RankOrder]:
    """Every rank's order, rank `r` on `seats[r]`."""
    seen: dict[str, int] = {}
    orders = []
    for rank, seat in enumerate(seats):
        seen[seat.node] = seen.get(seat.node, -1) + 1
        orders.append(RankOrder(rank=rank, local_rank=seen[seat.node], world_size=len(seats),
                                master_addr=master_addr, master_port=master_port, interface=seat.interface,
                                device_index=seat.device_index if device == "cuda" else None,
                                launch_t=launch_t, gpus=list(gpus)))
    return orders


class StandbyOrder(BaseModel):
    """What a local standby reads on its stdin (one JSON line): its segment's
    folder, the log to write to, its rank's order, and the account it runs the
    segment as (None: the launcher's own)."""

    model_config = ConfigDict(extra="forbid")

    segment_dir: str
    log: str
    order: RankOrder
    identity: RankIdentity | None = None
    spec_file: str = Field("spec.json", description="its SegmentSpec, in the segment's folder")
    round: int = Field(0, ge=0, description="the segment's round: 1 and on, resizes in place (regroup.py)")
    joins: bool = Field(False, description="it joins ranks that stay in a resize in place: state from them, "
                                           "not from a checkpoint")
