"""Reading the project's CSV input files, with errors a person can fix.

Cluster files (`data/clusters/*.csv`, `infra/cluster.csv`) are read by both the
worker and the simulator, so their loader lives here, below both: the worker
must not import the simulator to learn its cluster. `InputError` and
`csv_rows` are shared with the simulator's trace and throughput readers so
that every bad file fails with the same one-line message (file, row, field).
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Iterator

from scheduler_service.policy.topology import Topology

CLUSTER_COLUMNS = ("num_switch", "num_node_p_switch", "num_gpu_p_node")


class InputError(ValueError):
    """Bad input file: the message is one line naming file, row and field."""

    def __init__(self, path: Path | str, row: int | None, field: str | None, problem: str) -> None:
        self._parts = (path, row, field, problem)
        where = f"{path}"
        if row is not None:
            where += f", row {row}"
        if field is not None:
            where += f", field '{field}'"
        super().__init__(f"{where}: {problem}")

    def __reduce__(self):
        # Simulations run in worker processes; without this the error cannot be
        # sent back, and the caller sees a broken pool instead of the message.
        return type(self), self._parts


def csv_rows(path: Path) -> Iterator[tuple[int, dict[str, str]]]:
    """(line number, row) pairs; the first pair is the header (name -> name), for column checks."""
    try:
        with path.open(newline="") as fh:
            reader = csv.DictReader(fh)
            if reader.fieldnames is None:
                raise InputError(path, None, None, "empty file")
            yield 1, {name: name for name in reader.fieldnames}
            for number, row in enumerate(reader, start=2):
                yield number, row
    except OSError as exc:
        raise InputError(path, None, None, f"cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise InputError(path, None, None, "not a text CSV file") from None


def load_cluster(path: Path) -> Topology:
    """The topology in the first row of a cluster file."""
    path = Path(path)
    rows = csv_rows(path)
    _, header = next(rows)
    for name in CLUSTER_COLUMNS:
        if name not in header:
            raise InputError(path, 1, name, "missing column")
    for number, row in rows:
        values = {}
        for name in CLUSTER_COLUMNS:
            try:
                values[name] = int(row[name])
            except (TypeError, ValueError):
                raise InputError(path, number, name, f"not an integer: {row[name]!r}") from None
        try:
            return Topology(values["num_switch"], values["num_node_p_switch"], values["num_gpu_p_node"])
        except ValueError as exc:
            raise InputError(path, number, None, str(exc)) from None
    raise InputError(path, None, None, "no cluster row")
