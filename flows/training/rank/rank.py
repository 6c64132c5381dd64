"""One DDP rank's `Worker`: restore, train until told or done, checkpoint.

A process rank runs it from `rank_main.py` (a standby that imports torch,
then reads its order on stdin); a Ray rank actor runs the same `Worker`
with its order (`ray_actor.py`).
Rank 0 hears the scheduler's stop, which its coordinator forwards (it
reads no control folder); any rank that gets SIGTERM asks to stop. Both are
folded into one all-reduce per iteration, together with the loss, so every
rank stops at the same boundary.

A training step does not know whether it is about to be resized: it always
computes the gradient of the mean loss over the same global batch, split over
however many workers there are (see `sampler`).

A segment launched in place lives on across resizes (regroup.py): the same
process pauses, forms the next round's group, and trains on.

What tells a rank to stop from outside is a `StopFlags` its process entry
makes (here for a process rank, in `ray_actor.py` for a Ray one) and hands
to its `Worker`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elasticflow_block.storage import CheckpointInfo, CheckpointStorage
from flows.training.orders import RankOrder
from flows.training.rank.rank_setup import build_optimizer, rendezvous_store, rng_state, set_rng_state
from flows.training.regroup import Next, await_next, result_file, write_private
from flows.training.rank.sampler import batch_indices, micro_batches, shard_bounds
from flows.training.rank.saving import Saves, cpu_copy
from flows.training.segment import SegmentResult, SegmentSpec, SegmentTimings, StopReason
from flows.training.rank.stop_flags import StopFlags
from flows.training.supervision import PROGRESS_FILE, ProgressLine
from flows.training.rank.task import Task, make_deterministic, to_device

log = logging.getLogger("elasticflow.worker")


class Worker:
    """State of one rank for one segment, across its rounds: a resize in place
    (regroup.py) keeps the process, its model and optimizer, and forms a new
    process group for the next round."""

    def __init__(self, spec: SegmentSpec, segment_dir: Path, order: RankOrder, flags: StopFlags,
                 round_: int = 0) -> None:
        self.spec, self.dir, self.order, self.round, self.flags = spec, segment_dir, order, round_, flags
        self.rank, self.world = order.rank, order.world_size
        self.timings = SegmentTimings(launch_t=order.launch_t, imported_t=time.time())
        self.storage = CheckpointStorage(spec.checkpoint_url, keep=spec.keep_checkpoints)
        self.saves = Saves(self.storage, spec.run_key)
        self.device = torch.device("cuda", 0) if spec.device == "cuda" else torch.device("cpu")
        self.history: list[float] = []
        self.iteration = 0
        self.paused = False  # stopped in memory, waiting for the launcher's word (regroup.py)
        self.last_checkpoint: int | None = None  # the iteration of this run's newest checkpoint, as rank 0 knows

    def setup(self) -> None:
        if self.spec.hyperparameters.deterministic:
            make_deterministic()  # before CUDA is touched
        if self.spec.device == "cuda":
            torch.cuda.set_device(self.device)
        else:
            torch.set_num_threads(1)
        self._form_group()
        self.task = Task.of(self.spec)
        self.task.load()
        torch.manual_seed(self.spec.hyperparameters.seed)
        self.model = self.task.build_model().to(self.device)
        # Wrapped before restoring: DDP keeps references to the parameters, and
        # load_state_dict copies into them in place.
        self._wrap()
        self.optimizer = build_optimizer(self.model, self.spec)
        self.timings.ready_t = time.time()

    def _form_group(self) -> None:
        timeout = timedelta(seconds=self.spec.init_timeout_s)
        store = rendezvous_store(self.order.master_addr, self.order.master_port, self.rank, self.world, timeout)
        dist.init_process_group("nccl" if self.spec.device == "cuda" else "gloo", store=store, rank=self.rank,
                                world_size=self.world, timeout=timeout)
        self.timings.rendezvous_t = time.time()

    def _wrap(self) -> None:
        """DDP over the current group; its constructor broadcasts rank 0's
        parameters and buffers, which is how a rank that joins gets the model."""
        self.ddp = DistributedDataParallel(self.model, device_ids=[0] if self.spec.device == "cuda" else None)

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
            set_rng_state(state["rng"])
        dist.barrier()
        self.last_checkpoint = self.iteration
        self.timings.load_s = time.perf_counter() - start
        self.timings.loaded_t = time.time()
        return int(chosen.item()) if chosen.item() >= 0 else None

    def share_state(self, joins: bool) -> None:
        """Rank 0 (one that stayed) sends what the model's parameters do not
        hold: the optimizer's state, the iteration (and so the data
        position), the loss history and the random state. Those that `joins`
        take it; the others have it already."""
        start = time.perf_counter()
        held = [{"optimizer": self.optimizer.state_dict(), "iteration": self.iteration, "history": self.history,
                 "rng": rng_state()} if self.rank == 0 else None]
        dist.broadcast_object_list(held, src=0, device=self.device if self.spec.device == "cuda" else None)
        if joins:
            state = held[0]
            assert state is not None
            self.optimizer.load_state_dict(state["optimizer"])
            self.iteration, self.history = int(state["iteration"]), list(state["history"])
            set_rng_state(state["rng"])
        self.timings.load_s = time.perf_counter() - start
        self.timings.loaded_t = time.time()

    def start(self, joins: bool) -> None:
        """Set up, then take the run's state: from a survivor when it `joins`
        a resize in place, else from the newest checkpoint."""
        self.setup()
        if not joins:
            self.restore()
            return
        self.share_state(joins=True)
        t = self.timings
        log.info("joined round %d at iteration %d: took its order %.3f s after the launch, group formed %.3f s "
                 "later, model built %.3f s, state received %.3f s", self.round, self.iteration,
                 t.imported_t - t.launch_t, t.rendezvous_t - t.imported_t, t.ready_t - t.rendezvous_t, t.load_s)

    def rounds(self) -> bool:
        """Train round after round, each paused at its stop until the
        launcher's word (regroup.py), until the segment ends here; False
        when this rank left at a resize in place (its group is gone then)."""
        while True:
            start = self.iteration
            self.report(start, self.train())
            if not self.paused:
                return True
            what = self.resume()
            if what == "save":
                self.report(start, self.save_paused())
                return True
            if what == "leave":
                return False

    def resume(self) -> Literal["train", "leave", "save"]:
        """Paused at a stop: form the next round as the launcher says (train
        on in it, or leave), or save where it stands. Every
        rank acts alike: one that did not get the word (asked to stop,
        orphaned, told nothing in time) makes them all save."""
        self.settled()  # a rank 0 that leaves takes no half-written save along
        word = await_next(self.dir, self.round, go_on=lambda: not self.flags.terminated and not self.flags.orphaned)
        regroup = torch.tensor([float(word is not None and word.action == "regroup")], device=self.device)
        dist.all_reduce(regroup, op=dist.ReduceOp.MIN)
        if regroup.item() < 1 or word is None:
            return "save"
        return self._regroup(word)

    def _regroup(self, word: Next) -> Literal["train", "leave"]:
        order = word.orders.get(self.rank)
        staying = sum(o is not None for o in word.orders.values())
        # The DDP wrapper goes while every peer is alive: its reducer, freed
        # after a peer has gone, can wait for ever (see main). It has no
        # reference cycle: `del` frees it (a gc.collect() here took 0.1-0.4 s).
        start = time.perf_counter()
        del self.ddp
        dist.barrier()
        dist.destroy_process_group()
        log.info("round %d: old group gone in %.3f s", word.round, time.perf_counter() - start)
        if order is None:
            log.info("leaving at iteration %d (resize in place to round %d)", self.iteration, word.round)
            return "leave"
        self.spec = SegmentSpec.model_validate_json((self.dir / word.spec_file).read_text())
        self.order, self.rank, self.world, self.round = order, order.rank, order.world_size, word.round
        self.timings = SegmentTimings(launch_t=order.launch_t, imported_t=time.time())
        self.paused = False
        self._form_group()
        self._wrap()
        self.timings.ready_t = time.time()
        if staying < self.world:  # newcomers wait for the rest of the state
            self.share_state(joins=False)
        else:
            self.timings.loaded_t = time.time()
        log.info("round %d: rank %d of %d at iteration %d, in place; group formed in %.3f s, ready in %.3f s",
                 self.round, self.rank, self.world, self.iteration, self.timings.rendezvous_t - self.timings.imported_t,
                 self.timings.loaded_t - self.timings.imported_t)
        return "train"

    def save_paused(self) -> StopReason:
        """Told to end where it stands (parked, stopped, or off to GPUs none of
        these ranks hold): a checkpoint, retried as a stop's is (saving.py)."""
        self.paused = False
        while True:
            saved, give_up = self.checkpoint_together()
            if saved:
                return "terminated" if self.flags.terminated else "stopped"
            if give_up:
                return "save_failed"
            time.sleep(min(self.saves.retry_s, 5.0))

    def checkpoint(self, background: bool = False) -> bool:
        """Rank 0 saves (in the background: from a copy, saving.py); False if
        the store refused (saving.py says what then)."""
        if self.rank != 0:
            return True
        self.saves.join()
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "iteration": self.iteration,
            "history": list(self.history),
            "rng": rng_state(),
            "data": {
                "seed": self.spec.hyperparameters.seed,
                "global_batch_size": self.spec.hyperparameters.global_batch_size,
                "samples_seen": self.iteration * self.spec.hyperparameters.global_batch_size,
            },
            "meta": {"model": self.spec.model, "world_size": self.world, "saved_at": time.time()},
        }
        if background:  # the next step updates the parameters and the optimizer's state in place
            self.saves.save_later(self.iteration, cpu_copy(state), self._saved)
            return True
        info = self.saves.save(self.iteration, state)
        if info is None:
            return False
        self._saved(info)
        return True

    def _saved(self, info: CheckpointInfo) -> None:
        self.timings.save_s.append(info.seconds)
        self.last_checkpoint = info.iteration

    def settled(self) -> None:
        """What was saved is known: the background save in flight is done."""
        self.saves.join()

    def checkpoint_together(self) -> tuple[bool, bool]:
        """Rank 0 saves where every rank stands, unless it just did; all learn
        (saved, give up): only rank 0 knows whether its last save worked."""
        self.settled()
        saved = self.rank != 0 or self.last_checkpoint == self.iteration or self.checkpoint()
        verdict = torch.tensor([float(saved), float(self.saves.exhausted)], dtype=torch.float64, device=self.device)
        dist.broadcast(verdict, src=0)
        verdict = verdict.cpu()
        return bool(verdict[0] > 0), bool(verdict[1] > 0)

    def step(self) -> float:
        """One optimizer step over the global batch; returns this rank's summed loss."""
        hp = self.spec.hyperparameters
        indices = batch_indices(hp.seed, self.iteration, hp.global_batch_size, len(self.task))
        start, stop = shard_bounds(hp.global_batch_size, self.world, self.rank)
        chunks = micro_batches(start, stop, hp.max_micro_batch)
        # DDP averages gradients over ranks; scaling the summed loss by W/B makes
        # the result the gradient of the mean over the global batch, whatever W is.
        scale = self.world / hp.global_batch_size
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for j, (a, b) in enumerate(chunks):
            batch = to_device(self.task.batch(indices[a:b]), self.device)
            sync = contextlib.nullcontext() if j == len(chunks) - 1 else self.ddp.no_sync()
            with sync:
                summed = self.task.summed_loss(self.ddp, batch, b - a)
                (summed * scale).backward()
            total += float(summed.detach())
        self.optimizer.step()
        return total

    def stop_requested(self) -> bool:
        """A stop the scheduler asked for (a resize, a park, the end); while
        saves fail it is heard again only once a retry is due."""
        if self.rank != 0:
            return False  # rank 0 speaks for the run: only it knows whether a save can be made
        if self.saves.error is not None and not self.saves.may_retry():
            return False
        return self.flags.stop_asked(self.spec.applied_seq)

    def train(self) -> StopReason:
        """Train until done, stopped or terminated, and end on a checkpoint.
        A stop whose save fails is refused: every rank trains on where it is
        (saving.py); so does a finished segment, until its save works or
        too many failed."""
        spec = self.spec
        progress = open(self.dir / PROGRESS_FILE, "a") if self.rank == 0 else None
        while True:
            reason = self._train(progress)
            if spec.in_place and reason in ("stopped", "target"):
                self.paused = True  # no save: the launcher says what next (regroup.py)
                break
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
            terminate = self.flags.terminated or self.flags.orphaned
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
                self.checkpoint(background=True)
            if flags[1] > 0 or flags[2] > 0:
                self.timings.stop_seen_t = now
                return "terminated" if flags[2] > 0 else "stopped"
        return "completed" if self.iteration >= spec.total_iterations else "target"

    def report(self, start_iteration: int, reason: StopReason) -> None:
        if self.rank != 0:
            return
        self.settled()
        self.timings.end_t = time.time()
        result = SegmentResult(
            gpus=self.order.gpus,
            start_iteration=start_iteration,
            end_iteration=self.iteration,
            reason=reason,
            losses={i: self.history[i] for i in range(start_iteration, self.iteration)},
            history=self.history,
            timings=self.timings,
            checkpoint_iteration=self.last_checkpoint,
            error=self.saves.error if reason == "save_failed" else None,
            paused=self.paused,
            in_place=self.round > 0,
            metrics=self.task.evaluate(self.model) if reason == "completed" else {},
            deterministic=torch.are_deterministic_algorithms_enabled(),
        )
        write_private(self.dir / result_file(self.round), result.model_dump_json())
