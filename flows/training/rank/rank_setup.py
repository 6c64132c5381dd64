"""What a rank builds the same way in every segment, whatever it restores:
its optimizer, its random state, and the rendezvous that forms its process
group (at a launch, and again at every resize in place)."""

from __future__ import annotations

import random
import socket
import time
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from flows.training.segment import SegmentSpec


def build_optimizer(model: torch.nn.Module, spec: SegmentSpec) -> torch.optim.Optimizer:
    hp = spec.hyperparameters
    if hp.optimizer == "sgd":
        return torch.optim.SGD(
            model.parameters(), lr=hp.learning_rate, momentum=hp.momentum, weight_decay=hp.weight_decay
        )
    if hp.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=hp.learning_rate, weight_decay=hp.weight_decay)
    return torch.optim.AdamW(model.parameters(), lr=hp.learning_rate, weight_decay=hp.weight_decay)


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def rendezvous_store(addr: str, port: int, rank: int, world: int, timeout: timedelta) -> dist.TCPStore:
    """The job's rendezvous store, listening on `addr` only. torch's own
    TCPStore server listens on every interface (`*:<port>`, unauthenticated);
    handed a socket already bound to the job's address it listens there. The
    collectives' own sockets follow GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME,
    which the launcher sets to the same interface."""
    if rank != 0:
        _await_listener(addr, port, timeout.total_seconds())
        return dist.TCPStore(addr, port, world, is_master=False, timeout=timeout)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((addr, port))
    listener.listen(128)
    # detach: the store owns the descriptor from here on (and closes it)
    return dist.TCPStore(addr, port, world, is_master=True, timeout=timeout, master_listen_fd=listener.detach())


def _await_listener(addr: str, port: int, timeout_s: float, poll_s: float = 0.005) -> None:
    """Until rank 0's store listens. torch's client retries a refused
    connection after a growing back-off, and at a resize in place the ranks
    that join are there long before rank 0 (a survivor that first leaves its
    old group) listens: they joined 0.45 s late on every grow, most of it. A
    probe that connects and closes is nothing to the store; past `timeout_s`
    the store's own connect says what is wrong."""
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        try:
            with socket.create_connection((addr, port), timeout=1.0):
                return
        except OSError:
            time.sleep(poll_s)
