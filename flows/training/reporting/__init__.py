"""Reporting: the Prefect glue of a training run, its progress published to
Prefect (`prefect_progress`: a progress artifact, flow-run labels and
`elasticflow.training.*` events), on a thread of its own so the coordinator
never waits for Prefect.

It builds on the coordinator (`coordinator.progress.ProgressTracker`, which
it extends) and the shared modules; only the `train` flow imports it, so
the coordinator, the ranks and the worker run without it.
"""
