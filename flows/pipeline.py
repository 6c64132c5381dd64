"""An ML pipeline with an SLA: prepare data -> train -> evaluate -> register.

Deployed as `pipeline/daily` (entrypoint `flows.pipeline.daily_pipeline`) in
the elasticflow work pool, every day at 01:00 UTC with `sla="06:00Z"`: the
registered model is due at the next 06:00 UTC. The pipeline never names GPUs:
`train_model` derives the training deadline from the SLA minus the time
evaluation and registration took on recent days, and the scheduler admits or
rejects it at once.

It is small on purpose (generated vectors, the `mlp` model, a few hundred
iterations: under a minute on a CPU) and shows the three things a real
pipeline does around `train_model`: hand it data, read the checkpoint it
returns, and decide what to do when training is rejected.

    set -a; . ${ELASTICFLOW_HOME:-$HOME/.elasticflow}/client.env; set +a   # the stack's API URL and secret
    prefect deployment run pipeline/daily --param sla=+10m
"""

from __future__ import annotations

import json
import os
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run
from prefect.states import State
from pydantic import BaseModel, ConfigDict

from elasticflow_block.deadline import HistoryPolicy, SLATooClose, resolve_sla
from elasticflow_block.home import elasticflow_home
from elasticflow_block.errors import TrainingRejected, refusal_state
from elasticflow_block.pipeline import TrainedModel, train_model

DEFAULT_SLA = "06:00Z"  # a time of day: the next 06:00 UTC after the run starts
DOWNSTREAM = ["evaluate", "register"]  # task names after training, learned from their past runs
# Evaluation and registration take seconds here; before any history exists,
# reserve a minute for each rather than the library's five.
HISTORY = HistoryPolicy(statistic="p90", last_n=20, safety_factor=1.5, fallback=timedelta(minutes=1))
MARGIN = timedelta(seconds=30)
FEATURES, CLASSES = 32, 10


class PreparedData(BaseModel):
    """Train and test splits as `.npz` files the train flow's `npz` dataset reads."""

    model_config = ConfigDict(frozen=True)

    train: str
    test: str
    samples: int


class Evaluation(BaseModel):
    model_config = ConfigDict(frozen=True)

    accuracy: float
    loss: float
    samples: int
    checkpoint: str
    iteration: int


def _atomic_write(path: Path, data: bytes) -> None:
    """Write to a temporary name in the same folder, then rename: readers see all or nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


@task(name="prepare-data", cache_policy=NO_CACHE, persist_result=False)
def prepare_data(folder: str, samples: int = 2048, seed: int = 7) -> PreparedData:
    """Gaussian vectors labelled by a fixed random linear map; 80 % train, 20 % test.

    Written to files because the train flow runs in another process (maybe
    another machine with a shared store): data travels by location, not by value.
    """
    import io

    import numpy as np

    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((FEATURES, CLASSES))
    inputs = rng.standard_normal((samples, FEATURES)).astype(np.float32)
    targets = (inputs @ weights).argmax(axis=1).astype(np.int64)
    cut = int(samples * 0.8)
    paths = {}
    for split, rows in (("train", slice(0, cut)), ("test", slice(cut, samples))):
        buffer = io.BytesIO()
        np.savez(buffer, x=inputs[rows], y=targets[rows])
        path = Path(folder) / f"{split}.npz"
        _atomic_write(path, buffer.getvalue())
        paths[split] = str(path)
    get_run_logger().info("prepared data folder=%s train=%d test=%d", folder, cut, samples - cut)
    return PreparedData(train=paths["train"], test=paths["test"], samples=samples)


@task(name="evaluate", cache_policy=NO_CACHE, persist_result=False)
def evaluate(trained: TrainedModel, data: PreparedData) -> Evaluation:
    """Load the checkpoint training wrote (digest verified) into a fresh model and score it on held-out data."""
    import numpy as np
    import torch

    from flows.training.models import build_model, per_sample_loss

    state = trained.load_state()
    network = build_model(trained.model, trained.model_kwargs)
    network.load_state_dict(state["model"])
    network.eval()
    with np.load(data.test) as arrays:
        inputs, targets = torch.from_numpy(arrays["x"]), torch.from_numpy(arrays["y"]).long()
    with torch.no_grad():
        logits = network(inputs)
        loss = float(per_sample_loss(logits, targets).mean())
        accuracy = float((logits.argmax(dim=1) == targets).float().mean())
    get_run_logger().info(
        "evaluated checkpoint=%s iteration=%d accuracy=%.4f loss=%.4f", trained.checkpoint, state["iteration"],
        accuracy, loss,
    )
    return Evaluation(accuracy=accuracy, loss=loss, samples=len(targets), checkpoint=trained.checkpoint,
                      iteration=int(state["iteration"]))


@task(name="register", cache_policy=NO_CACHE, persist_result=False)
def register(trained: TrainedModel, evaluation: Evaluation, sla: datetime, registry: str) -> str:
    """One JSON entry per registered model under `registry/<model>/`, and `latest.json` pointing at it."""
    now = datetime.now(timezone.utc)
    entry: dict[str, Any] = {
        "model": trained.model,
        "model_kwargs": trained.model_kwargs,
        "checkpoint": trained.checkpoint,
        "checkpoint_store": trained.checkpoint_store,
        "run_key": trained.run_key,
        "iteration": trained.iteration,
        "train_flow_run_id": trained.flow_run_id,
        "pipeline_flow_run_id": str(flow_run.id) if flow_run.id else None,
        "metrics": {"accuracy": evaluation.accuracy, "loss": evaluation.loss, "samples": evaluation.samples},
        "sla": sla.isoformat(),
        "training_deadline": trained.deadline.isoformat(),
        "registered_at": now.isoformat(),
        "met_sla": now <= sla,
    }
    folder = Path(registry) / trained.model
    path = folder / f"{now.strftime('%Y%m%dT%H%M%SZ')}-{trained.run_key[:8]}.json"
    body = json.dumps(entry, indent=2, sort_keys=True).encode()
    _atomic_write(path, body)
    _atomic_write(folder / "latest.json", body)
    get_run_logger().info("registered model=%s entry=%s met_sla=%s", trained.model, path, entry["met_sla"])
    return str(path)


def _scheduled_start() -> datetime:
    """When this run was due to start: what a time-of-day or relative SLA counts from.

    A 01:00 run that a stopped worker starts at 06:05 is still due at today's
    06:00 (and fails as too late, saying so), not quietly at tomorrow's.
    """
    now = datetime.now(timezone.utc)
    scheduled = flow_run.scheduled_start_time
    return min(scheduled, now) if isinstance(scheduled, datetime) and scheduled.tzinfo else now


def _refused(key: str, title: str, body: str) -> None:
    """An artifact on the pipeline run saying why it will not deliver on time."""
    create_markdown_artifact(key=key, markdown=f"**{title}**\n\n{body}",
                             description="Training could not be scheduled to meet this pipeline's SLA")


@flow(name="pipeline", persist_result=False)
def daily_pipeline(
    sla: str | None = None,
    model: str = "mlp",
    iterations: int = 300,
    samples: int = 2048,
    learning_rate: float = 0.05,
) -> str | State:
    """Prepare data, train against the SLA, evaluate the checkpoint, register it; returns the registry entry
    (a Failed state named TrainingRejected or SLATooClose when training was refused).

    `sla`: when the registered model is due: ISO-8601 with a zone, `+1h`, or a
    time of day such as `06:00Z` (its next occurrence); default `06:00Z`.
    """
    logger = get_run_logger()
    due = resolve_sla(sla or DEFAULT_SLA, _scheduled_start())
    home = elasticflow_home()
    run_key = str(flow_run.id or uuid.uuid4())
    data = prepare_data.submit(str(home / "pipeline" / run_key), samples)
    try:
        trained = train_model(
            model,
            {"global_batch_size": 32, "learning_rate": learning_rate},
            sla=due,
            downstream=DOWNSTREAM,
            after=[data],
            iterations=iterations,
            dataset={"name": "npz", "path": data.result().train},
            model_kwargs={"in_features": FEATURES, "num_classes": CLASSES},
            parameters={"checkpoint_interval": max(1, iterations // 2)},
            margin=MARGIN,
            history=HISTORY,
            poll_interval_s=2.0,
        )
    except TrainingRejected as rejected:
        # A real pipeline picks one: relax the SLA to rejected.earliest_feasible_sla,
        # retry with a smaller model or fewer iterations, or page someone. Here: say
        # exactly what was refused and fail the run, which an automation can alert
        # on. An expected refusal: a named Failed state with the message, no traceback.
        earliest = rejected.earliest_feasible_sla.isoformat() if rejected.earliest_feasible_sla else "unknown"
        _refused("pipeline-training-rejected", f"training rejected: `{rejected.reason}`",
                 f"{rejected.message}\n\nearliest feasible SLA: {earliest}")
        logger.error("training rejected reason=%s earliest_feasible_sla=%s", rejected.reason, earliest)
        return refusal_state(rejected)
    except SLATooClose as too_close:  # nothing was submitted: no time was left to train
        _refused("pipeline-training-rejected", "no time left to train", str(too_close))
        logger.error("training not submitted: %s", too_close)
        return refusal_state(too_close)
    evaluation = evaluate(trained, data.result())
    return register(trained, evaluation, due, str(home / "registry"))


if __name__ == "__main__":
    daily_pipeline(sla="+10m")
