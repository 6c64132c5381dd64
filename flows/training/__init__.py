"""Elastic DDP training runtime behind the `train` flow (no Prefect imports here,
so worker processes start fast).

One sub-package per layer: `launch` (what the `elasticflow` worker uses to
start a run's processes, and how they stop), `coordinator` (the flow
process driving a run's segments of ranks; the worker runs it only to
profile), `rank` (a rank process, where the user's code runs; the worker
never imports it) and `reporting` (progress published to Prefect). The modules left here
are what several layers share: the run's parameters and the registries
they name (`params`, `models`, `datasets`, `allowlist`), the take-in check
of a user's task (`task_check`), what the coordinator and its ranks
exchange (`segment`, `orders`, `regroup`, `supervision`), the scheduler's
control channel (`control`) and the Ray cluster as both the service and a
run read it (`ray_nodes`). They import no sub-package but `launch`, except
`task_check`'s checking process, which imports `rank.task` as a rank would.
"""
