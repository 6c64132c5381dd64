"""What runs on the Ray nodes: a rank actor (the small tasks the
coordinating flow process pins on a node are `node_tasks`). See
`flows.training.coordinator.ray_ranks` for the coordinator's side.

A rank actor is one DDP rank for one segment: it says where it landed, then
trains with the same `Worker` a local rank process uses, from a folder of
its own on its node (0700; spec, progress, log). Threaded, so that
`progress` and `stop` are answered while `run` trains.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
import tempfile
from pathlib import Path
from typing import Any

from flows.training.ray_nodes import loopback_before_import

loopback_before_import()

import ray  # noqa: E402

from flows.training.orders import RankOrder, free_port  # noqa: E402
from flows.training.regroup import result_file, spec_file, write_private  # noqa: E402
from flows.training.segment import SegmentSpec  # noqa: E402
from flows.training.rank.stop_flags import StopFlags  # noqa: E402
from flows.training.supervision import ProgressLine, read_progress  # noqa: E402


class MisplacedRank(RuntimeError):
    """A rank is not where the placement says (or cannot get there)."""


def interface_of(ip: str) -> str:
    """The network interface holding `ip` (Linux): the collectives bind there."""
    if ip.startswith("127."):
        return "lo"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == ip:
                return name
    raise MisplacedRank(f"no interface holds {ip}")


@ray.remote(num_cpus=0, max_concurrency=4)
class RankActor:
    """One rank. Threaded: `progress` and `stop` are answered while `run` trains."""

    def __init__(self) -> None:
        import torch  # noqa: F401
        import torch._dynamo  # noqa: F401  # the first optimizer step imports it: ~2 s

        os.umask(0o077)  # checkpoints, logs, progress: private
        self.dir: Path | None = None
        self.worker: Any = None  # flows.training.rank.rank.Worker, once the segment started
        # Its parent is its node's raylet: Ray ends it with its owner, the flow process.
        self.flags = StopFlags(parent_pid=None)

    def where(self) -> dict[str, Any]:
        ip = ray.util.get_node_ip_address()
        return {"node": ray.get_runtime_context().get_node_id(), "ip": ip, "pid": os.getpid(),
                "host": socket.gethostname(), "interface": interface_of(ip)}

    def free_port(self, ip: str) -> int:
        """A port for the rendezvous, free on this node's address."""
        return free_port(ip)

    def run(self, spec_json: str, order: RankOrder, round_: int = 0, joins: bool = False) -> str:
        """Train the segment as the order's rank, across its resizes in place
        (regroup.py): rank 0 returns the result, a rank that leaves "" (its
        process ends with the actor, which the coordinator kills)."""
        import torch

        from flows.training.rank import rank as rank_mod

        os.environ.update(order.env())
        self.dir = Path(tempfile.mkdtemp(prefix="elasticflow-rank-"))
        handler = logging.FileHandler(self.dir / "rank.log")
        handler.setFormatter(logging.Formatter(f"%(asctime)s rank={order.rank} %(name)s %(levelname)s %(message)s"))
        logging.getLogger().addHandler(handler)
        logging.getLogger().setLevel(logging.INFO)
        spec = SegmentSpec.model_validate_json(spec_json)
        if spec.device == "cuda" and torch.cuda.device_count() != 1:
            raise MisplacedRank(f"rank {order.rank} sees {torch.cuda.device_count()} CUDA devices, not GPU "
                                 f"{order.device_index} alone")
        write_private(self.dir / spec_file(round_), spec_json)
        worker = self.worker = rank_mod.Worker(spec, self.dir, order, self.flags, round_)
        worker.start(joins)
        if not worker.rounds():
            return ""  # it left at a resize in place: the coordinator ends this actor
        torch.distributed.barrier()  # every rank is past its last collective; the process ends with the actor
        return (self.dir / result_file(worker.round)).read_text() if worker.rank == 0 else ""

    def progress(self, offset: int, round_: int = 0) -> tuple[list[ProgressLine], int, str]:
        """Rank 0's progress lines from byte `offset` on, and its result of
        `round_` once there is one (else ""): a paused round's says so."""
        if self.dir is None:
            return [], offset, ""
        lines, offset = read_progress(self.dir, offset)
        path = self.dir / result_file(round_)
        return lines, offset, path.read_text() if path.exists() else ""

    def tell(self, files: dict[str, str]) -> None:
        """The coordinator's word for this paused rank (regroup.py), written
        into its folder in the order given: the new round's spec before the
        `next-<round>.json` the rank waits for."""
        assert self.dir is not None
        for name, text in files.items():
            write_private(self.dir / name, text)

    def stop(self, terminate: bool, seq: int = 0) -> None:
        """Stop at the next iteration boundary: the scheduler's stop for its
        command `seq` (dropped if it comes late, StopFlags.stop_asked), or
        the run's end."""
        if terminate:
            self.flags.terminate()
        else:
            self.flags.ask_stop(seq)

    def cleanup(self) -> None:
        """The segment ended well: its folder (spec, progress, log) is not needed."""
        import shutil

        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)

    def log_tail(self, chars: int = 2000) -> str:
        path = self.dir / "rank.log" if self.dir else None
        return path.read_text(errors="replace")[-chars:] if path and path.exists() else ""
