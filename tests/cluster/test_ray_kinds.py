"""A real loopback Ray cluster whose nodes are of two kinds: the service reads
two pools from it, and a run's ranks land on the kind its GPU ids name."""

from __future__ import annotations

import time
from typing import Any, Callable

from flows.training.params import TrainParameters
from flows.training.coordinator.runtime import run_training
from scheduler_service.policy.topology import MixedTopology
from scheduler_service.stack.ray_local import LocalRayCluster
from tests.ray_cluster import alive_nodes


def test_nodes_of_another_kind_are_a_pool_of_their_own_and_runs_land_on_each(
        ray_cluster: LocalRayCluster, ray_address: str, make_params: Callable[..., TrainParameters]) -> None:
    from flows.training.ray_nodes import KIND_RESOURCE, SLOTS_RESOURCE
    from flows.training.coordinator.profiler import profile_throughput
    from scheduler_service.store import get_curves
    from scheduler_service.worker.intake import read_request
    from scheduler_service.worker.profiling import measure_where_runs_train
    from scheduler_service.worker.ray_backend import RayBackend

    # The session's two nodes name no kind; a third one declares kind T4 and
    # has 4 slots where they have 2: a node of another size, of another kind.
    extra: Any = ray_cluster.cluster.add_node(
        num_cpus=4, num_gpus=0, resources={SLOTS_RESOURCE: 4, KIND_RESOURCE + "T4": 1}, node_name="ray-node-t4",
        node_ip_address="127.0.0.1", object_store_memory=96 * 1024**2)
    try:
        ray_cluster.cluster.wait_for_nodes()
        cluster = RayBackend(ray_address).cluster()
        assert isinstance(cluster.topology, MixedTopology)
        assert cluster.topology.kinds == ("unnamed", "T4") and not cluster.left_out
        assert cluster.describe().startswith("unnamed: 1 switch x 2 nodes x 2 GPUs = 4 GPUs + T4: 1 switch x 1 nodes "
                                             "x 4 GPUs = 4 GPUs")
        t4 = next(n["NodeID"] for n in alive_nodes() if n["NodeName"] == "ray-node-t4")
        assert {s.node for s in cluster.locate((4, 5, 6, 7))} == {t4}  # type: ignore[union-attr]

        seen: list[Any] = []
        on_t4 = run_training(make_params(gpu_plan=[[4, 5, 6, 7]], iterations=10), "on-t4", segment_hook=seen.append)
        on_other = run_training(make_params(gpu_plan=[[0, 1]], iterations=10), "on-the-other",
                                segment_hook=seen.append)
        assert on_t4.status == "completed" and on_other.status == "completed"
        assert {r.where["node"] for r in seen[0].ranks} == {t4}
        assert t4 not in {r.where["node"] for r in seen[1].ranks}

        # A model the service profiles on first use is measured on the nodes
        # of the GPUs it was given, as Ray actors, and kept as that kind's curve.
        profiled: list[Any] = []
        curve = profile_throughput("mlp", 32, [1, 2], iterations=6, warmup=2, device="cpu", gpu_ids=[4, 5],
                                   timeout_s=240, ray_address=ray_address, placement=cluster.locate((4, 5)),
                                   segment_hook=profiled.append)
        assert set(curve) == {1, 2} and [len(s.ranks) for s in profiled] == [1, 2]
        assert {r.where["node"] for s in profiled for r in s.ranks} == {t4}  # there, not in this machine's processes
        measure = measure_where_runs_train("cpu", 6, 240, lambda: cluster, ray_address)
        request = read_request({"model": "mlp", "iterations": 10, "device": "cpu",
                                "hyperparameters": {"global_batch_size": 32}}, 0.0)
        measured = measure(request, [4, 5], True)
        assert get_curves("mlp", 32) == {"": measured, "T4": measured}  # T4's, and the stand-in for the rest
    finally:
        ray_cluster.cluster.remove_node(extra, allow_graceful=False)
        # Ray still lists a node killed so for a few seconds: the next test's
        # GPU ids, numbered over the live nodes, would count its slots.
        give_up = time.monotonic() + 60
        while any(n["NodeName"] == "ray-node-t4" for n in alive_nodes()) and time.monotonic() < give_up:
            time.sleep(0.2)

