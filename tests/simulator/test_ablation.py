"""bench/ablation.py: a variant changes only the run it is applied to."""

import subprocess
import sys
from pathlib import Path

ABLATION = Path(__file__).resolve().parents[2] / "bench" / "ablation.py"


def test_a_variant_changes_its_own_row_and_leaves_the_shipped_row_as_the_policy_gives_it():
    from scheduler_service.simulator.experiment import Experiment, data_dir

    data = data_dir()
    _, shipped = Experiment(data / "reference/traces/dev102.csv", data / "clusters/n8g8.csv",
                            data / "throughputs/A100", actuations=("ideal",)).run(["elasticflow"])  # the policy alone
    out = subprocess.run(
        [sys.executable, str(ABLATION), "--variant", "backward-filled", "--variant", "shipped",
         "--trace", "dev102", "--workers", "1"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout.splitlines()
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1].rstrip(" |") for line in out[2:]}
    assert float(rows["`elasticflow` as shipped"].split()[0]) == round(shipped[0].deadline_ratio, 3)
    # Backward-filled plans are a different policy on dev102 (0.790 against 0.898), and the
    # shipped row run after it in the same pool is not touched by its strategies.
    assert rows["1. plans filled backwards from the deadline, not moved forward"] != rows["`elasticflow` as shipped"]
