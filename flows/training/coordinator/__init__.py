"""The coordinator: what runs in a run's flow process, independent of Prefect,
and drives its segments of ranks. The elastic loop (`runtime`) and a run's
state between segments (`run_state`), where the ranks run (`ranks`: local
processes through `launcher`, or Ray actors through `ray_ranks`, `ray_pool`
and `ray_where`), a SIGTERM on the flow process (`termination`), the run's
progress figures in its status file (`progress`) and throughput profiling
with the same loop (`profiler`).

It may import the shared modules at the top of `flows.training`, `launch`
(standbys, identity) and, from `rank`, only the Ray actor it places
(`rank.ray_actor`); never `reporting`, which builds on it.
"""
