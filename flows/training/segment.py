"""What a segment is given and what it reports back, shared by the launcher
(in the flow process) and the workers (separate processes). Plain pydantic, no
torch and no Prefect, so both sides import it cheaply."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field

from flows.training.datasets import DatasetSpec
from flows.training.params import Hyperparameters

if TYPE_CHECKING:
    from flows.training.params import TrainParameters

StopReason = Literal["completed", "target", "stopped", "terminated", "crashed", "save_failed"]


class SegmentSpec(BaseModel):
    """One launch of `world_size` workers, from the latest checkpoint up to `stop_at`."""

    run_key: str
    model: str
    model_kwargs: dict[str, Any] = Field(default_factory=dict)
    dataset: DatasetSpec
    loss: str = "cross_entropy"
    collate: str | None = None
    evaluate: str | None = None
    hyperparameters: Hyperparameters
    total_iterations: int
    stop_at: int = Field(description="iteration at which this segment ends even if not told to stop")
    checkpoint_interval: int
    checkpoint_url: str
    keep_checkpoints: int = 3
    device: Literal["cpu", "cuda"] = "cpu"
    control_dir: str | None = None
    applied_seq: int = 0
    save_at_end: bool = True
    init_timeout_s: float = 120.0
    in_place: bool = Field(False, description="at a stop, pause in memory for a resize in place (regroup.py) "
                                              "rather than checkpoint and exit")

    @classmethod
    def of_run(cls, params: TrainParameters, **segment: Any) -> SegmentSpec:
        """A segment of the run `params` describes: what to train comes from the
        run (the training loop and the profiler must not disagree on it), where
        it stops and where it checkpoints from `segment`."""
        run = dict(
            model=params.model,
            model_kwargs=params.model_kwargs,
            dataset=params.dataset,
            loss=params.loss,
            collate=params.collate,
            evaluate=params.evaluate,
            hyperparameters=params.hyperparameters,
            checkpoint_interval=params.checkpoint_interval,
            keep_checkpoints=params.keep_checkpoints,
        )
        return cls(**(run | segment))


class SegmentTimings(BaseModel):
    """Wall-clock instants (time.time()) and durations measured by rank 0."""

    launch_t: float = 0.0
    imported_t: float = 0.0  # interpreter up, torch imported
    rendezvous_t: float = 0.0  # process group up
    ready_t: float = 0.0  # data and model built
    loaded_t: float = 0.0  # checkpoint restored, DDP wrapped: ready for the first new iteration
    first_iteration_t: float | None = None
    stop_seen_t: float | None = None  # iteration boundary at which a stop request was seen
    end_t: float = 0.0  # after the final checkpoint
    load_s: float = 0.0
    save_s: list[float] = Field(default_factory=list)
    iteration_end_t: dict[int, float] = Field(default_factory=dict)


class SegmentResult(BaseModel):
    gpus: list[int]
    start_iteration: int
    end_iteration: int
    reason: StopReason
    losses: dict[int, float] = Field(
        default_factory=dict, description="this segment's global mean loss by iteration index"
    )
    history: list[float] = Field(
        default_factory=list, description="the run's whole loss history, from the checkpoint on"
    )
    timings: SegmentTimings = Field(default_factory=SegmentTimings)
    checkpoint_iteration: int | None = None
    error: str | None = None
    failure: str | None = Field(default=None, description="a crash's cause, as supervision.Failure says it")
    paused: bool = Field(False, description="its ranks wait in memory for a resize in place (regroup.py)")
    in_place: bool = Field(False, description="its ranks kept their state from the segment before (no checkpoint)")
    metrics: dict[str, float] = Field(default_factory=dict, description="the task's evaluation, once the run completed")
    deterministic: bool = Field(False, description="rank 0 trained with deterministic algorithms only")

    @property
    def iterations_per_s(self) -> float | None:
        """Steady-state rate, first iteration excluded (it pays for warm-up)."""
        ends = sorted(self.timings.iteration_end_t.items())
        if len(ends) < 3:
            return None
        (i0, t0), (i1, t1) = ends[1], ends[-1]
        return (i1 - i0) / (t1 - t0) if t1 > t0 else None
