"""A real loopback Ray cluster whose nodes are of two kinds: the service reads
two pools from it, and a run's ranks land on the kind its GPU ids name."""

from __future__ import annotations

from typing import Any, Callable

from flows.training.params import TrainParameters
from flows.training.runtime import run_training
from scheduler_service.policy.topology import MixedTopology
from scheduler_service.stack.ray_local import LocalRayCluster
from tests.cluster.conftest import alive_nodes


def test_nodes_of_another_kind_are_a_pool_of_their_own_and_runs_land_on_each(
        ray_cluster: LocalRayCluster, ray_address: str, make_params: Callable[..., TrainParameters]) -> None:
    from flows.training.ray_nodes import KIND_RESOURCE, SLOTS_RESOURCE
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
        assert {w["node"] for w in seen[0].where} == {t4}
        assert t4 not in {w["node"] for w in seen[1].where}
    finally:
        ray_cluster.cluster.remove_node(extra, allow_graceful=False)
