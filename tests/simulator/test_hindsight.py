"""bench/hindsight.py: a policy given hindsight's jobs is counted over the whole trace."""

import subprocess
import sys
from pathlib import Path

HINDSIGHT = Path(__file__).resolve().parents[2] / "bench" / "hindsight.py"


def test_the_policy_columns_count_every_deadline_job_and_the_first_is_the_default_as_it_runs():
    from scheduler_service.policy.registry import DEFAULT_POLICY
    from scheduler_service.simulator.experiment import Experiment, data_dir

    data = data_dir()
    _, bare = Experiment(data / "reference/traces/dev101.csv", data / "clusters/n16g8.csv",
                         data / "throughputs/A100", actuations=("ideal",)).run([DEFAULT_POLICY])
    out = subprocess.run([sys.executable, str(HINDSIGHT), "--trace", "dev101", "--workers", "1"],
                         capture_output=True, text=True, timeout=300, check=True).stdout.splitlines()
    cells = [float(c.split()[0]) for c in out[2].strip("| ").split(" | ")[1:]]
    *policies, chosen, lp = cells
    assert policies[0] == round(bare[0].deadline_ratio, 3)
    # Counted over the trace's deadline jobs, a policy given hindsight's jobs meets at most
    # the share hindsight chose (counted over its own jobs it could reach 1.0), and the
    # integral choice is within the LP bound.
    assert all(p <= chosen for p in policies[2:])
    assert 0.5 < chosen <= lp + 1e-3
