"""Elastic DDP training runtime behind the `train` flow (no Prefect imports here,
so worker processes start fast)."""
