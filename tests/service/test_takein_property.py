"""No input crashes the worker: generated parameter sets, well-formed or not,
thrown at take-in and at the policy in one poll's worth of runs. The worker
survives every batch and every run gets its decision at once where its
model's curve is stored (admitted, or rejected with a reason naming what
failed), or waits in Profiling at a batch size never measured."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.service.offline import Entry, FlowRun, offline_worker

NOW = 1_800_000_000.0
BATCHES = (1, 2, 16, 32)

anything = st.one_of(st.none(), st.booleans(), st.integers(-10**20, 10**20),
                     st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                     st.lists(st.integers(-3, 3), max_size=3), st.dictionaries(st.text(max_size=5), st.integers(),
                                                                               max_size=2))
deadlines = st.one_of(st.just("+1h"), st.just("+2s"), st.just("none"), st.just(""), st.just("2001-01-01T00:00:00Z"),
                      st.just("9999-12-31T23:59:59Z"), st.sampled_from(["+0s", "+1000000000w", "tomorrow"]),
                      anything)
parameter_sets = st.fixed_dictionaries(
    {"model": st.one_of(st.just("mlp"), st.sampled_from(["resnet-50", "pkg.mod:factory", "x:y:z", ""]), anything)},
    optional={
        "iterations": st.one_of(st.integers(-5, 10**16), anything),
        "epochs": st.one_of(st.floats(-1, 1e7), anything),
        "deadline": deadlines,
        "best_effort": st.one_of(st.booleans(), anything),
        "hyperparameters": st.one_of(st.fixed_dictionaries({"global_batch_size": st.sampled_from(BATCHES)}),
                                     st.fixed_dictionaries({"global_batch_size": st.integers(-5, 10**12)}), anything),
        "checkpoint_store": st.one_of(st.just("../../etc"), st.just("s3://b/x"), st.just("/etc"), anything),
        "dataset": st.one_of(st.just("npz:/etc/passwd"), st.just("synthetic"), anything),
        "checkpoint_interval": st.one_of(st.integers(-5, 10**12), anything),
        "unknown_field": anything,
    })


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from scheduler_service.store import save_curve

    monkeypatch = pytest.MonkeyPatch()
    worker = offline_worker(tmp_path_factory.mktemp("takein"), monkeypatch)
    for model in ("mlp", "resnet", "vgg", "transformer"):  # every registered model is profiled already
        for batch in BATCHES:
            save_curve(model, batch, {1: 50.0, 2: 90.0} if batch > 1 else {1: 50.0})
    yield worker
    monkeypatch.undo()


async def _poll(worker: Any, batch: list[dict[str, Any]], now: float) -> list[str]:
    entries = [Entry(FlowRun(parameters)) for parameters in batch]
    await worker.take_in.take(entries, now)  # what the poll does with new training runs
    await worker.decide(now)
    return [str(entry.flow_run.id) for entry in entries]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(batch=st.lists(parameter_sets, min_size=1, max_size=6))
@example(batch=[{"model": "mlp", "hyperparameters": {"global_batch_size": 3}}])  # never measured
def test_every_generated_run_is_decided_and_the_worker_survives(worker: Any, batch: list[dict[str, Any]]) -> None:
    ids = asyncio.run(_poll(worker, batch, NOW))
    states = worker.reporter.publisher.states
    for run_id in ids:  # a decision, once; an admitted run may be Waiting already (best-effort, no spare GPU)
        if states.get(run_id) == "Profiling":  # valid, at a batch size never measured: decided once profiled
            assert run_id in worker.profiler.waiting and not worker.reporter.store.decisions(run_id)
            continue
        assert len(worker.reporter.store.decisions(run_id)) == 1, (run_id, states.get(run_id))
        assert states.get(run_id) in ("Rejected", "Admitted", "Best-effort", "Waiting"), (run_id, states.get(run_id))
    for run_id in ids:  # done with them: the next batch starts from an empty cluster
        asyncio.run(worker.ended(run_id))
