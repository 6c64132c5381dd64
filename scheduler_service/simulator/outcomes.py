"""Per-job outcomes, and lining them up against another simulator's.

A deadline ratio says how many jobs a policy met; to learn why two policies
differ one has to see which jobs each met, and for a job only one of them met,
what the other decided and why. The simulator writes one row per job (the
decision the policy returned, with its reason and MSS, and what then
happened); `line_up` joins such rows with a reference file of
`job_id, decision, met` rows, like data/reference/outcomes/*.csv.
"""

from __future__ import annotations

import csv
import io
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from scheduler_service.simulator.engine import JobRecord, Run
from scheduler_service.simulator.inputs import InputError
from scheduler_service.simulator.report import write_atomically

JOB_COLUMNS = ["policy", "job_id", "submit_time", "deadline", "model", "batch_size", "iterations",
               "decision", "reason", "earliest_feasible_deadline", "guaranteed", "mss", "start", "finish", "met",
               "restarts", "peak_gpus"]
VERDICTS = ("both met", "only ours met", "only the reference met", "neither met")


def _num(value: float | None) -> str:
    return "" if value is None else f"{value:.0f}"


def decision_of(record: JobRecord) -> str:
    """admitted / rejected / best_effort, the words the reference files use
    (they say `declined` for rejected)."""
    if record.job.deadline is None:
        return "best_effort"
    if record.decision is None:
        return "undecided"
    return "admitted" if record.decision.admitted else "rejected"


def job_rows(run: Run) -> list[dict[str, str]]:
    rows = []
    for record in run.records:
        job, decision = record.job, record.decision
        reason = ""
        if decision is not None and not decision.admitted:  # a baseline may reject with a message only
            reason = decision.reason.value if decision.reason is not None else decision.message
        rows.append({
            "policy": run.policy, "job_id": job.job_id, "submit_time": _num(job.submit_time),
            "deadline": _num(job.deadline), "model": job.model, "batch_size": str(job.batch_size),
            "iterations": _num(job.iterations), "decision": decision_of(record), "reason": reason,
            "earliest_feasible_deadline": _num(None if decision is None else decision.earliest_feasible_deadline),
            "guaranteed": str(int(decision is not None and decision.guaranteed)),
            "mss": "" if decision is None or decision.share is None else str(decision.share),
            "start": _num(record.start), "finish": _num(record.finish),
            "met": "" if job.deadline is None else str(int(record.met_deadline)),
            "restarts": str(record.restarts), "peak_gpus": str(record.peak_gpus),
        })
    return rows


def _csv_bytes(columns: Sequence[str], rows: Iterable[dict[str, str]]) -> bytes:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(columns), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue().encode()


def write_jobs_csv(path: Path, runs: Sequence[Run]) -> None:
    write_atomically(path, _csv_bytes(JOB_COLUMNS, (row for run in runs for row in job_rows(run))))


def _read(path: Path, required: Sequence[str]) -> list[dict[str, str]]:
    path = Path(path)
    try:
        with path.open(newline="") as fh:
            reader = csv.DictReader(fh)
            missing = [c for c in required if c not in (reader.fieldnames or [])]
            if missing:
                raise InputError(path, 1, missing[0], "missing column")
            return list(reader)
    except OSError as exc:
        raise InputError(path, None, None, f"cannot read: {exc.strerror or exc}") from None


def read_jobs_csv(path: Path, policy: str | None = None) -> tuple[str, dict[str, dict[str, str]]]:
    """One policy's rows of a `--jobs-csv` file (the first policy in it unless named)."""
    rows = _read(path, JOB_COLUMNS)
    policies = list(dict.fromkeys(row["policy"] for row in rows))
    if not policies:
        raise InputError(path, None, None, "no jobs in the file")
    chosen = policy or policies[0]
    if chosen not in policies:
        raise InputError(path, None, "policy", f"no rows for policy {chosen!r} (the file has: {', '.join(policies)})")
    return chosen, {row["job_id"]: row for row in rows if row["policy"] == chosen}


def read_reference(path: Path, policy: str | None = None) -> dict[str, dict[str, str]]:
    """A reference per-job file, or one policy's rows of our own `--jobs-csv`
    file, so two of our policies can be lined up the same way."""
    rows = _read(path, ["job_id", "decision", "met"])
    if rows and "policy" in rows[0]:
        return read_jobs_csv(path, policy)[1]
    if policy is not None:
        raise InputError(path, 1, "policy", "a reference file without a policy column has one set of outcomes")
    return {row["job_id"]: row for row in rows}


def reference_ratio(reference: dict[str, dict[str, str]]) -> float:
    """Met / deadline jobs of a reference outcomes file (best-effort rows left out)."""
    deadline = [row for row in reference.values() if row["decision"] != "best_effort"]  # ours too
    return sum(row["met"] == "1" for row in deadline) / len(deadline) if deadline else 1.0


@dataclass
class Comparison:
    """Deadline jobs sorted by who met them, with both sides' rows."""

    policy: str
    rows: dict[str, list[tuple[dict[str, str], dict[str, str]]]] = field(default_factory=dict)  # verdict -> jobs

    def count(self, verdict: str) -> int:
        return len(self.rows.get(verdict, []))

    @property
    def deadline_jobs(self) -> int:
        return sum(len(v) for v in self.rows.values())

    def why_only_reference(self) -> Counter[str]:
        """Our decision and reason for the jobs only the reference met."""
        return Counter(f"{o['decision']} {o['reason'] or ('late' if o['decision'] == 'admitted' else '')}".strip()
                       for o, _ in self.rows.get("only the reference met", []))

    def why_only_ours(self) -> Counter[str]:
        """The reference's decision for the jobs only we met (admitted = admitted, then late)."""
        return Counter(r["decision"] for _, r in self.rows.get("only ours met", []))


def line_up(policy: str, ours: dict[str, dict[str, str]], reference: dict[str, dict[str, str]],
            where: str = "reference") -> Comparison:
    """Join by job id; the two files must cover the same jobs."""
    missing = sorted(set(reference) ^ set(ours), key=lambda j: (len(j), j))
    if missing:
        side = "ours" if missing[0] in reference else "the reference"
        raise InputError(where, None, "job_id", f"job {missing[0]!r} is missing from {side} "
                         f"({len(missing)} jobs differ): were both run on the same trace?")
    comparison = Comparison(policy, {v: [] for v in VERDICTS})
    for job_id, ref in reference.items():
        if ref["decision"] == "best_effort":
            continue
        mine = ours[job_id]
        verdict = VERDICTS[(mine["met"] != "1") * 2 + (ref["met"] != "1")]
        comparison.rows[verdict].append((mine, ref))
    return comparison


LINED_UP_COLUMNS = ["job_id", "verdict", "submit_time", "deadline", "model", "batch_size", "iterations",
                    "decision", "reason", "earliest_feasible_deadline", "mss", "start", "finish", "met",
                    "reference_decision", "reference_met"]


def write_lined_up(path: Path, comparison: Comparison) -> None:
    rows = []
    for verdict, pairs in comparison.rows.items():
        for mine, ref in pairs:
            row = {c: mine.get(c, "") for c in LINED_UP_COLUMNS}
            row.update(job_id=ref["job_id"], verdict=verdict, reference_decision=ref["decision"],
                       reference_met=ref["met"])
            rows.append(row)
    rows.sort(key=lambda r: float(r["submit_time"] or 0))
    write_atomically(path, _csv_bytes(LINED_UP_COLUMNS, rows))
