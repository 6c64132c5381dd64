"""Profiling on first use, without a server: runs of one model share one
measurement, its GPUs are reserved while it runs, and a failure or a wait
past the timeout is that run's rejection with the reason. On a cluster of
two kinds, the kind the first profile did not measure is measured when a
block of it is free, with no run waiting for it."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from scheduler_service.contracts import RejectionReason
from scheduler_service.loop import ControlLoop, LoopSettings
from scheduler_service.loop.events import Reserved
from scheduler_service.policy import Topology
from scheduler_service.policy.topology import AnyTopology, MixedTopology
from scheduler_service.worker.intake import Request, new_run, read_request
from scheduler_service.worker.profiling import ProfileOutcome, Profiler

NOW = 1_800_000_000.0


class Profiling:
    """A profiler beside the control loop it reserves GPUs in, as the worker drives them."""

    def __init__(self, measure, timeout_s: float = 600.0, topology: AnyTopology = Topology(1, 1, 2)
                 ) -> None:  # type: ignore[no-untyped-def]
        self.loop = ControlLoop(topology, LoopSettings(policy="elasticflow", interval_s=2.0))
        self.profiler = Profiler(measure, device="cpu", timeout_s=timeout_s)

    def poll(self, now: float) -> list[ProfileOutcome]:
        outcomes, reservations = self.profiler.poll(now, self.loop, max_job_gpus=2)
        for event in reservations:
            self.loop.handle(event, now)
        return outcomes

    def reserved(self) -> set[int]:
        return {gpu for gpu, holder in self.loop.gpu_map().items() if holder.startswith("service:")}


def _run(tmp: Path, run_id: str, batch: int = 32):  # type: ignore[no-untyped-def]
    request = read_request({"model": "mlp", "iterations": 50, "hyperparameters": {"global_batch_size": batch}}, NOW)
    return new_run(run_id, run_id, request, str(tmp), NOW)


def _until(profiling: Profiling, now: float, count: int) -> list:  # type: ignore[type-arg]
    for _ in range(200):
        outcomes = profiling.poll(now)
        if outcomes:
            return outcomes
        time.sleep(0.02)
    raise AssertionError("no outcome")


def test_runs_of_one_model_share_one_measurement_on_reserved_gpus(tmp_path: Path) -> None:
    release, calls = threading.Event(), []

    def measure(request: Request, gpus: list[int], stand_in: bool) -> dict[int, float]:
        calls.append(tuple(gpus))
        release.wait(5)
        return {1: 10.0, 2: 18.0}

    profiling = Profiling(measure)
    profiling.profiler.wait_for(_run(tmp_path, "a"))
    profiling.profiler.wait_for(_run(tmp_path, "b"))
    assert profiling.poll(NOW) == []
    assert profiling.reserved() == {0, 1}  # nobody is launched onto them meanwhile
    release.set()
    outcomes = _until(profiling, NOW + 1, 2)
    assert sorted(o.run.run_id for o in outcomes) == ["a", "b"] and calls == [(0, 1)]
    assert all(o.points == {1: 10.0, 2: 18.0} for o in outcomes)
    assert profiling.reserved() == set() and profiling.profiler.sizes() == {
        "waiting": 0, "running": 0, "queued": 0, "blocked": 0, "later": 0, "measuring": 0, "incomplete": 0, "completing": 0, "narrow": 0}


def test_a_failed_measurement_rejects_its_runs_with_the_users_error(tmp_path: Path) -> None:
    def measure(request: Request, gpus: list[int], stand_in: bool) -> dict[int, float]:
        raise RuntimeError("CUDA out of memory in your model")

    profiling = Profiling(measure)
    profiling.profiler.wait_for(_run(tmp_path, "a"))
    (outcome,) = _until(profiling, NOW, 1)
    assert outcome.points is None and outcome.reason is RejectionReason.PROFILING_FAILED
    assert "RuntimeError: CUDA out of memory in your model" in outcome.message


def test_no_free_gpus_for_longer_than_the_timeout_is_a_rejection_naming_the_holders(tmp_path: Path) -> None:
    profiling = Profiling(lambda request, gpus, stand_in: {1: 1.0}, timeout_s=60.0)
    profiling.loop.handle(Reserved("someone else", (0, 1)), NOW)
    profiling.profiler.wait_for(_run(tmp_path, "a"))
    assert profiling.poll(NOW + 30) == []
    (outcome,) = profiling.poll(NOW + 61)
    assert outcome.reason is RejectionReason.PROFILING_FAILED and "held: 0: service:someone else" in outcome.message
    assert profiling.profiler.sizes()["queued"] == 0  # its only run gave up: nothing left waiting to be measured


def _until_idle(profiling: Profiling, now: float) -> None:
    for _ in range(200):
        assert profiling.poll(now) == []
        if not profiling.profiler.sizes()["measuring"]:
            return
        time.sleep(0.02)
    raise AssertionError("still measuring")


def _called(calls: list, count: int) -> None:  # type: ignore[type-arg]
    for _ in range(200):
        if len(calls) >= count:
            return
        time.sleep(0.02)
    raise AssertionError(f"{len(calls)} measurements, not {count}")


def test_the_other_kind_is_measured_once_a_block_of_it_is_free_and_no_run_waits_for_it(tmp_path: Path) -> None:
    calls: list[tuple[tuple[int, ...], bool]] = []
    release = threading.Event()

    def measure(request: Request, gpus: list[int], stand_in: bool) -> dict[int, float]:
        calls.append((tuple(gpus), stand_in))
        if not stand_in:
            release.wait(5)
        return {1: 10.0, 2: 18.0}

    two_kinds = MixedTopology.of([("A100", Topology(1, 1, 2)), ("T4", Topology(1, 1, 2))])
    profiling = Profiling(measure, topology=two_kinds)
    profiling.loop.handle(Reserved("someone else", (2, 3)), NOW)  # the T4s are busy
    profiling.profiler.wait_for(_run(tmp_path, "a"))
    (outcome,) = _until(profiling, NOW, 1)
    assert outcome.points == {1: 10.0, 2: 18.0} and calls == [((0, 1), True)]  # A100, kept as the stand-in too
    assert profiling.poll(NOW + 1) == [] and profiling.profiler.sizes()["later"] == 1  # waits for a free T4 block
    from scheduler_service.loop.events import Unreserved

    profiling.loop.handle(Unreserved("someone else"), NOW + 2)
    assert profiling.poll(NOW + 3) == []
    _called(calls, 2)
    assert calls[1] == ((2, 3), False) and profiling.reserved() == {2, 3}  # T4's own, nobody put on them meanwhile
    release.set()
    _until_idle(profiling, NOW + 4)
    assert profiling.reserved() == set()
    profiling.profiler.measure_later(outcome.run.request, ["A100", "T4"])  # both measured: not again
    assert profiling.profiler.sizes()["later"] == 0


def test_measuring_another_kind_waits_for_runs_that_wait_for_their_profile(tmp_path: Path) -> None:
    calls: list[tuple[tuple[int, ...], bool]] = []
    release = threading.Event()

    def measure(request: Request, gpus: list[int], stand_in: bool) -> dict[int, float]:
        calls.append((tuple(gpus), stand_in))
        release.wait(5)
        return {1: 10.0}

    two_kinds = MixedTopology.of([("A100", Topology(1, 1, 2)), ("T4", Topology(1, 1, 2))])
    profiling = Profiling(measure, topology=two_kinds)
    first = _run(tmp_path, "a")
    profiling.profiler.measure_later(first.request, ["T4"])  # as take-in asks, for a kind the store lacks
    profiling.profiler.wait_for(_run(tmp_path, "b", batch=64))  # another model's first use: a run waits
    assert profiling.poll(NOW) == [] and calls == [((0, 1), True)]
    assert profiling.profiler.sizes()["later"] == 1  # not started beside it, though the T4s are free
    release.set()
    _until(profiling, NOW + 1, 1)
    _until_idle(profiling, NOW + 2)
    profiling.poll(NOW + 3)
    _called(calls, 3)
    _until_idle(profiling, NOW + 4)
    # T4 for the first model, then both kinds for the second (measured on A100 for its run)
    assert sorted(calls[1:]) == [((2, 3), False), ((2, 3), False)]


def test_a_later_measurement_keeps_the_stand_in_and_stores_the_kinds_own_curve(tmp_path: Path,
                                                                              monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from scheduler_service.store import get_curves, save_curve
    from scheduler_service.worker.cluster import Cluster
    from scheduler_service.worker.profiling import measure_where_runs_train

    monkeypatch.setenv("ELASTICFLOW_HOME", str(tmp_path / "home"))
    two_kinds = MixedTopology.of([("A100", Topology(1, 1, 1)), ("T4", Topology(1, 1, 1))])
    cluster = Cluster(two_kinds, "cpu", ("node-0", "node-1"), "test")
    save_curve("mlp", 32, {1: 123.0}, device="cpu")
    save_curve("mlp", 32, {1: 123.0}, device="cpu", kind="A100")
    measure = measure_where_runs_train("cpu", 4, 120, lambda: cluster, None)
    curve = measure(_run(tmp_path, "a").request, [1], False)
    assert set(curve) == {1} and curve[1] > 0
    assert get_curves("mlp", 32) == {"": {1: 123.0}, "A100": {1: 123.0}, "T4": curve}


def test_a_model_given_by_import_path_is_imported_only_in_the_ranks_never_the_worker(
        tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Issue 43: profiling built `TrainParameters` importing the user's
    module, so its import code ran in the worker beside every secret of the
    stack. Take-in and the worker's own measurement leave no mark of this
    process; the ranks trained the model (the curve is measured)."""
    import os
    import sys

    from scheduler_service.worker import cluster as cluster_mod
    from scheduler_service.worker.profiling import measure_where_runs_train

    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv("ELASTICFLOW_TEST_MARKS", str(marks))
    monkeypatch.setenv("ELASTICFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("ELASTICFLOW_DATABASE_URL", raising=False)
    module = "tests.runtime.marking_model"
    sys.modules.pop(module, None)
    request = read_request({"model": f"{module}:marked", "dataset": "synthetic-vectors", "iterations": 20,
                            "hyperparameters": {"global_batch_size": 8}}, NOW)
    cluster = cluster_mod.load(Path(__file__).parents[2] / "infra" / "local-cpu2.csv", None)
    measure = measure_where_runs_train("cpu", 6, 120.0, lambda: cluster, None)
    curve = measure(request, [0], True)
    assert set(curve) == {1} and curve[1] > 0
    assert not (marks / f"imported-{os.getpid()}").exists() and module not in sys.modules


def test_a_profile_taken_beside_a_busy_gpu_is_partial_and_completed_before_it_caps_a_run(tmp_path: Path) -> None:
    """Issue 42: the first resnet run arrived while one of two slots was
    taken; profiling measured 1 GPU only, and every later resnet run was
    planned on at most 1 GPU and refused as "even the whole cluster at 1
    GPUs cannot finish". Now the curve is partial: a run that needs more
    than it measured waits for it to be measured on both GPUs once they are
    free, and is then admitted on both."""
    from scheduler_service.loop.actions import Admitted, ProfileNeeded, Rejected
    from scheduler_service.loop.events import Unreserved
    from scheduler_service.worker.intake import arrival

    calls: list[tuple[int, ...]] = []

    def measure(request: Request, gpus: list[int], stand_in: bool) -> dict[int, float]:
        calls.append(tuple(gpus))
        return {1: 10.0, 2: 18.0} if len(gpus) == 2 else {1: 10.0}

    def resnet(run_id: str, iterations: int, deadline_in_s: float):  # type: ignore[no-untyped-def]
        request = read_request({"model": "resnet", "iterations": iterations, "deadline": f"+{deadline_in_s:.0f}s",
                                "hyperparameters": {"global_batch_size": 32}}, NOW)
        return new_run(run_id, run_id, request, str(tmp_path), NOW)

    profiling = Profiling(measure)
    profiling.loop.handle(Reserved("someone else", (1,)), NOW)  # one of the two slots is taken
    profiling.profiler.wait_for(resnet("first", 100, 1500))
    (first,) = _until(profiling, NOW, 1)
    assert calls == [(0,)] and first.points == {1: 10.0} and first.measured_up_to == 1  # partial: GPU 1 was busy
    assert profiling.profiler.sizes()["incomplete"] == 1  # to be completed when a wider block is free

    urgent = resnet("urgent", 3000, 270)  # 300 s on one GPU, 167 s on two: only two GPUs meet it
    loop = profiling.loop
    loop.handle(arrival(urgent, first.points, 2, NOW + 1, measured_up_to=first.measured_up_to), NOW + 1)
    actions = loop.step(NOW + 1)
    assert not [a for a in actions if isinstance(a, Rejected)]  # not refused for counts never measured
    (needed,) = [a for a in actions if isinstance(a, ProfileNeeded)]
    assert needed.measured_up_to == 1 and loop.view("urgent", NOW + 1) is None  # the profiler's again

    profiling.profiler.complete_for(urgent, needed.measured_up_to)
    assert profiling.poll(NOW + 2) == [] and calls == [(0,)]  # one GPU free only: not measured again on it
    loop.handle(Unreserved("someone else"), NOW + 3)
    (completed,) = _until(profiling, NOW + 4, 1)
    assert calls == [(0,), (0, 1)] and completed.points == {1: 10.0, 2: 18.0} and completed.measured_up_to is None
    loop.handle(arrival(urgent, completed.points, 2, NOW + 5, measured_up_to=completed.measured_up_to), NOW + 5)
    (admitted,) = [a for a in loop.step(NOW + 5) if isinstance(a, Admitted)]
    assert admitted.run_id == "urgent" and admitted.guaranteed and admitted.share == 2  # planned on both GPUs
    _until_idle(profiling, NOW + 6)
    assert profiling.reserved() == set() and profiling.profiler.sizes()["narrow"] == 0


def test_a_curve_measured_on_fewer_gpus_than_the_model_could_use_is_stored_as_partial_until_completed(
        tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from scheduler_service.store import get_curves
    from scheduler_service.store.throughput import partial_kinds
    from scheduler_service.worker.cluster import Cluster
    from scheduler_service.worker.profiling import measure_where_runs_train

    monkeypatch.setenv("ELASTICFLOW_HOME", str(tmp_path / "home"))
    cluster = Cluster(Topology(1, 1, 2), "cpu", ("node-0",), "test")
    measure = measure_where_runs_train("cpu", 4, 600, lambda: cluster, None)  # two ranks start slowly on a busy machine
    request = _run(tmp_path, "a").request
    measure(request, [0], True)  # GPU 1 was busy
    assert set(get_curves("mlp", 32)[""]) == {1} and partial_kinds("mlp", 32) == {""}
    measure(request, [0, 1], True)  # completed once both were free
    assert set(get_curves("mlp", 32)[""]) == {1, 2} and partial_kinds("mlp", 32) == set()
