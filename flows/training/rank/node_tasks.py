"""The small tasks the coordinating flow process pins on a Ray node: is it
up, are a segment's processes gone. Apart from the rank actor's module, which
imports torch (its specs do): a task worker that only waits for PIDs needs
none of it, and each one that imported it spent ~1.5 s of CPU on a node
whose ranks were starting.
"""

from __future__ import annotations

import os
import time

from flows.training.ray_nodes import loopback_before_import

loopback_before_import()

import ray  # noqa: E402


@ray.remote(num_cpus=0)
def await_exit(pids: list[int], timeout_s: float) -> list[int]:
    """On the ranks' node: wait for their processes to be gone; those still there."""
    def there(pid: int) -> bool:
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as fh:
                return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    give_up = time.monotonic() + timeout_s
    while any(there(p) for p in pids) and time.monotonic() < give_up:
        time.sleep(0.02)
    return [p for p in pids if there(p)]


@ray.remote(num_cpus=0)
def node_id_here() -> str:
    return ray.get_runtime_context().get_node_id()
