"""The scheduling policy: pure code (no Prefect, no database, no clock, no I/O)
shared by the trace simulator and the Prefect scheduler service."""

from scheduler_service.policy.interface import (
    Decision,
    RejectionReason,
    SchedulingPolicy,
    SchedulingReply,
    SchedulingRequest,
)
from scheduler_service.policy.jobs import Job, JobStatus, ThroughputCurve
from scheduler_service.policy.registry import POLICIES, make_policy
from scheduler_service.policy.topology import Topology

__all__ = [
    "Decision", "Job", "JobStatus", "POLICIES", "RejectionReason", "SchedulingPolicy",
    "SchedulingReply", "SchedulingRequest", "ThroughputCurve", "Topology", "make_policy",
]
