"""Launch: how the `elasticflow` worker starts a run's processes and how they
stop. The flow process's entry (`boot`) and its warm fork server
(`forkserver`), what the worker tells it (`spec.LaunchSpec`), the standby
rank processes and their environment allow-list (`standby`), the account the
ranks run as (`identity`) and the stack's `stopping` mark (`pause`).

The bottom layer: at import, the standard library and pydantic only (Prefect
and torch only inside the functions that start or warm a process), and
nothing of `flows.training` outside this package, so that the worker starts
runs without loading the rank's code. The rank's entry (`rank.rank_main`) and
the `train` flow are named only in the process that becomes them (a forked
standby, the fork server's warm-up).
"""
