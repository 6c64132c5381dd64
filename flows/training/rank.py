"""One DDP worker process: restore, train until told or done, checkpoint, exit.

Started as a standby (`python -m flows.training.rank --standby [EARLY_LOG]`,
see `flows.training.standby`): it imports torch, then reads its order on
stdin (`orders.StandbyOrder`: the segment's folder, its log, its rank's
`RankOrder`). A Ray rank actor runs the same `Worker` with its order.
Rank 0 polls the control channel; any rank
that gets SIGTERM asks to stop. Both are folded into one all-reduce per
iteration, together with the loss, so every rank stops at the same boundary.

A training step does not know whether it is about to be resized: it always
computes the gradient of the mean loss over the same global batch, split over
however many workers there are (see `sampler`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elasticflow_block.storage import CheckpointStorage
from flows.training.control import FileControlChannel
from flows.training.datasets import load_dataset
from flows.training.models import build_model, per_sample_loss
from flows.training.orders import RankOrder, StandbyOrder
from flows.training.sampler import batch_indices, micro_batches, shard_bounds
from flows.training.saving import Saves
from flows.training.segment import SegmentResult, SegmentSpec, SegmentTimings, StopReason
from flows.training.supervision import PROGRESS_FILE, ProgressLine

log = logging.getLogger("elasticflow.worker")

_terminated = False
_stop_asked = False  # the launcher asked this rank to stop (ranks run as Ray actors read no control folder)
_parent_pid: int | None = os.getppid()  # the flow process that launched this worker (None: a Ray actor)


def _on_sigterm(signum: int, frame: Any) -> None:
    global _terminated
    _terminated = True


def _orphaned() -> bool:
    """The flow process is gone (SIGKILLed: Prefect's hard kill of a cancelled
    run reaches its PID only, not its workers). Stop and checkpoint at this
    boundary instead of training on for nobody, on GPUs the scheduler has
    given to someone else."""
    return _parent_pid is not None and os.getppid() != _parent_pid


def build_optimizer(model: torch.nn.Module, spec: SegmentSpec) -> torch.optim.Optimizer:
    hp = spec.hyperparameters
    if hp.optimizer == "sgd":
        return torch.optim.SGD(
            model.parameters(), lr=hp.learning_rate, momentum=hp.momentum, weight_decay=hp.weight_decay
        )
    if hp.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=hp.learning_rate, weight_decay=hp.weight_decay)
    return torch.optim.AdamW(model.parameters(), lr=hp.learning_rate, weight_decay=hp.weight_decay)


def _rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def _set_rng_state(state: dict[str, Any]) -> None:
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
        return dist.TCPStore(addr, port, world, is_master=False, timeout=timeout)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((addr, port))
    listener.listen(128)
    # detach: the store owns the descriptor from here on (and closes it)
    return dist.TCPStore(addr, port, world, is_master=True, timeout=timeout, master_listen_fd=listener.detach())


class Worker:
    """State of one rank for one segment."""

    def __init__(self, spec: SegmentSpec, segment_dir: Path, order: RankOrder) -> None:
        self.spec, self.dir, self.order = spec, segment_dir, order
        self.rank, self.world = order.rank, order.world_size
        self.timings = SegmentTimings(launch_t=order.launch_t, imported_t=time.time())
        self.storage = CheckpointStorage(spec.checkpoint_url, keep=spec.keep_checkpoints)
        self.saves = Saves(self.storage, spec.run_key)
        self.control = FileControlChannel(spec.run_key, spec.control_dir) if spec.control_dir else None
        self.device = torch.device("cuda", 0) if spec.device == "cuda" else torch.device("cpu")
        self.history: list[float] = []
        self.iteration = 0

    def setup(self) -> None:
        if self.spec.device == "cuda":
            torch.cuda.set_device(self.device)
            backend = "nccl"
        else:
            torch.set_num_threads(1)
            backend = "gloo"
        timeout = timedelta(seconds=self.spec.init_timeout_s)
        store = rendezvous_store(self.order.master_addr, self.order.master_port, self.rank, self.world, timeout)
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world, timeout=timeout)
        self.timings.rendezvous_t = time.time()
        self.data = load_dataset(self.spec.dataset)
        torch.manual_seed(self.spec.hyperparameters.seed)
        self.model = build_model(self.spec.model, self.spec.model_kwargs).to(self.device)
        # Wrapped before restoring: DDP keeps references to the parameters, and
        # load_state_dict copies into them in place.
        self.ddp = DistributedDataParallel(self.model, device_ids=[0] if self.spec.device == "cuda" else None)
        self.optimizer = build_optimizer(self.model, self.spec)
        self.timings.ready_t = time.time()

    def restore(self) -> int | None:
        """Load the newest valid checkpoint. Rank 0 picks it (falling back past a
        corrupt one) and tells the others which iteration to load, so all ranks
        restore the same state."""
        start = time.perf_counter()
        chosen = torch.tensor([-1], dtype=torch.long, device=self.device)  # nccl needs device tensors
        state = None
        if self.rank == 0:
            found = self.storage.load_latest(self.spec.run_key)
            if found:
                state = found[0]
                chosen[0] = found[1].iteration
        dist.broadcast(chosen, src=0)
        chosen = chosen.cpu()
        if chosen.item() >= 0 and state is None:
            state = self.storage.load(self.spec.run_key, int(chosen.item()))[0]
        if state is not None:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.iteration = int(state["iteration"])
            self.history = list(state["history"])
            _set_rng_state(state["rng"])
        dist.barrier()
        self.timings.load_s = time.perf_counter() - start
        self.timings.loaded_t = time.time()
        return int(chosen.item()) if chosen.item() >= 0 else None

    def checkpoint(self) -> bool:
        """Rank 0 saves; False if the store refused (saving.py says what then)."""
        if self.rank != 0:
            return True
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "iteration": self.iteration,
            "history": self.history,
            "rng": _rng_state(),
            "data": {
                "seed": self.spec.hyperparameters.seed,
                "global_batch_size": self.spec.hyperparameters.global_batch_size,
                "samples_seen": self.iteration * self.spec.hyperparameters.global_batch_size,
            },
            "meta": {"model": self.spec.model, "world_size": self.world, "saved_at": time.time()},
        }
        info = self.saves.save(self.iteration, state)
        if info is None:
            return False
        self.timings.save_s.append(info.seconds)
        self.last_checkpoint = self.iteration
        return True

    def checkpoint_together(self) -> tuple[bool, bool]:
        """Rank 0 saves where every rank stands, unless it just did; all learn
        (saved, give up): only rank 0 knows whether its last save worked."""
        saved = self.rank != 0 or self.last_checkpoint == self.iteration or self.checkpoint()
        verdict = torch.tensor([float(saved), float(self.saves.exhausted)], dtype=torch.float64, device=self.device)
        dist.broadcast(verdict, src=0)
        verdict = verdict.cpu()
        return bool(verdict[0] > 0), bool(verdict[1] > 0)

    def step(self) -> float:
        """One optimizer step over the global batch; returns this rank's summed loss."""
        hp = self.spec.hyperparameters
        indices = batch_indices(hp.seed, self.iteration, hp.global_batch_size, len(self.data))
        start, stop = shard_bounds(hp.global_batch_size, self.world, self.rank)
        chunks = micro_batches(start, stop, hp.max_micro_batch)
        # DDP averages gradients over ranks; scaling the summed loss by W/B makes
        # the result the gradient of the mean over the global batch, whatever W is.
        scale = self.world / hp.global_batch_size
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for j, (a, b) in enumerate(chunks):
            inputs, targets = self.data.batch(indices[a:b])
            inputs, targets = inputs.to(self.device), targets.to(self.device)
            sync = contextlib.nullcontext() if j == len(chunks) - 1 else self.ddp.no_sync()
            with sync:
                losses = per_sample_loss(self.ddp(inputs), targets)
                (losses.sum() * scale).backward()
            total += float(losses.detach().sum())
        self.optimizer.step()
        return total

    def stop_requested(self) -> bool:
        """A stop the scheduler asked for (a resize, a park, the end); while
        saves fail it is heard again only once a retry is due."""
        if self.rank != 0:
            return False  # rank 0 speaks for the run: only it knows whether a save can be made
        if self.saves.error is not None and not self.saves.may_retry():
            return False
        return _stop_asked or bool(self.control and self.control.pending(self.spec.applied_seq))

    def train(self) -> StopReason:
        """Train until done, stopped or terminated, and end on a checkpoint.
        A stop whose save fails is refused: every rank trains on where it is
        (saving.py); so does a finished segment, until its save works or
        too many failed."""
        spec = self.spec
        progress = open(self.dir / PROGRESS_FILE, "a") if self.rank == 0 else None
        self.last_checkpoint = self.iteration
        while True:
            reason = self._train(progress)
            if reason in ("terminated", "save_failed") or not spec.save_at_end:
                break
            saved, give_up = self.checkpoint_together()
            if saved:
                break
            if give_up:
                reason = "save_failed"
                break
            if reason != "stopped":  # nothing left to train: try again shortly
                time.sleep(min(self.saves.retry_s, 5.0))
        if reason == "terminated" and spec.save_at_end and self.last_checkpoint != self.iteration:
            self.checkpoint()  # going anyway (cancelled, preempted): whatever the store takes
        if progress:
            progress.close()
        return reason

    def _train(self, progress: Any) -> StopReason:
        spec = self.spec
        if self.iteration >= spec.total_iterations:
            return "completed"
        while self.iteration < min(spec.stop_at, spec.total_iterations):
            local = self.step()
            # [summed loss, stop votes, terminate votes, give-up votes]: one
            # collective per iteration. The stop is read first: a SIGTERM
            # landing between the two reads then counts as a termination
            # (read the other way round, it passed for a plain stop, and a
            # preempted run ended "stopped").
            stop = self.stop_requested()
            terminate = _terminated or _orphaned()
            flags = torch.tensor([local, float(stop or terminate), float(terminate), float(self.saves.exhausted)],
                                 dtype=torch.float64, device=self.device)
            dist.all_reduce(flags)
            flags = flags.cpu()
            loss = float(flags[0]) / spec.hyperparameters.global_batch_size
            self.history.append(loss)
            self.iteration += 1
            now = time.time()
            if self.timings.first_iteration_t is None:
                self.timings.first_iteration_t = now
            self.timings.iteration_end_t[self.iteration] = now
            if len(self.timings.iteration_end_t) > 512:  # bounded: enough for rates, small result files
                del self.timings.iteration_end_t[min(self.timings.iteration_end_t)]
            if progress:
                progress.write(ProgressLine(self.iteration, loss, now, self.saves.error).json() + "\n")
                progress.flush()
            if flags[3] > 0:
                return "save_failed"
            if self.iteration % spec.checkpoint_interval == 0:
                self.checkpoint()
            if flags[1] > 0 or flags[2] > 0:
                self.timings.stop_seen_t = now
                return "terminated" if flags[2] > 0 else "stopped"
        return "completed" if self.iteration >= spec.total_iterations else "target"

    def report(self, start_iteration: int, reason: StopReason) -> None:
        if self.rank != 0:
            return
        self.timings.end_t = time.time()
        result = SegmentResult(
            gpus=self.order.gpus,
            start_iteration=start_iteration,
            end_iteration=self.iteration,
            reason=reason,
            losses={i: self.history[i] for i in range(start_iteration, self.iteration)},
            history=self.history,
            timings=self.timings,
            checkpoint_iteration=getattr(self, "last_checkpoint", None),
            error=self.saves.error if reason == "save_failed" else None,
        )
        tmp = self.dir / "result.json.tmp"
        tmp.write_text(result.model_dump_json())
        os.replace(tmp, self.dir / "result.json")


def main(order: StandbyOrder) -> NoReturn:
    signal.signal(signal.SIGTERM, _on_sigterm)
    os.umask(0o077)  # checkpoints, logs, progress: private, whoever started this rank
    rank = order.order.rank
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank={rank} %(name)s %(levelname)s %(message)s",
                        force=True)  # a worker forked from a flow process inherits its handlers
    folder = Path(order.segment_dir)
    spec = SegmentSpec.model_validate_json((folder / "spec.json").read_text())
    worker = Worker(spec, folder, order.order)
    worker.setup()
    worker.restore()
    start_iteration = worker.iteration
    reason = worker.train()
    worker.report(start_iteration, reason)
    dist.barrier()
    dist.destroy_process_group()
    # Exit from here: returning would free `worker` (its DDP model and reducer),
    # whose process-group destructors can wait for ever on a peer that has
    # already exited (seen about once in ten 2-worker segments with gloo).
    _exit(0)


def standby(early_log: str | None = None) -> int:
    """Wait, with torch already imported, for the launcher to hand over a segment.

    The launcher writes one JSON line on stdin, a `StandbyOrder`: the segment
    folder, the log file, and the rank's order, whose environment (rank,
    rendezvous, CUDA_VISIBLE_DEVICES) is applied before anything touches
    CUDA. EOF means the launcher is gone: exit quietly. `early_log` holds
    what this process said before it had a segment (for a crash report); it
    is removed once the segment's own log takes over.
    """
    import torch._dynamo  # noqa: F401  # the first optimizer step imports it: ~2 s

    line = sys.stdin.readline()
    if not line.strip():
        if early_log:
            with contextlib.suppress(OSError):
                os.unlink(early_log)
        return 0
    order = StandbyOrder.model_validate_json(line)
    os.environ.update(order.order.env())
    if early_log:  # while it is still the launcher's to remove
        with contextlib.suppress(OSError):
            os.unlink(early_log)
    if order.identity is not None:  # before the segment's files, the user's model or data are touched
        order.identity.assume(Path(order.segment_dir))
    fd = os.open(order.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return main(order)


def run_standby(forked: bool = False, early_log: str | None = None) -> None:
    """Be a standby until handed a segment, run it, exit. `forked`: this process
    was forked from its launcher (`WorkerPool.fork`), which is now its parent."""
    global _parent_pid
    if forked:
        _parent_pid = os.getppid()
    _exit(standby(early_log))


def _exit(code: int) -> NoReturn:
    # Everything is on disk (checkpoint, result.json); skip interpreter teardown,
    # which takes ~1 s with torch loaded and sits on the rescale path.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    if sys.argv[1:2] != ["--standby"]:
        sys.exit("usage: python -m flows.training.rank --standby [EARLY_LOG] (started by flows.training.standby)")
    run_standby(early_log=sys.argv[2] if len(sys.argv) > 2 else None)
