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
from typing import TYPE_CHECKING, Iterator

from scheduler_service.policy.topology import AnyTopology, MixedTopology, Topology

if TYPE_CHECKING:
    from scheduler_service.policy.teams import Team

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


def load_cluster(path: Path) -> AnyTopology:
    """The topology of a cluster file: its first row, or, with a `gpu_kind`
    column, one pool per row (a cluster of several GPU kinds, in the order
    given; `cluster_speeds` reads the rest of such a file)."""
    path = Path(path)
    rows = csv_rows(path)
    _, header = next(rows)
    for name in CLUSTER_COLUMNS:
        if name not in header:
            raise InputError(path, 1, name, "missing column")
    kinds: list[tuple[str, Topology]] = []
    for number, row in rows:
        values = {}
        for name in CLUSTER_COLUMNS:
            try:
                values[name] = int(row[name])
            except (TypeError, ValueError):
                raise InputError(path, number, name, f"not an integer: {row[name]!r}") from None
        try:
            topology = Topology(values["num_switch"], values["num_node_p_switch"], values["num_gpu_p_node"])
        except ValueError as exc:
            raise InputError(path, number, None, str(exc)) from None
        if "gpu_kind" not in header:
            return topology
        kind = (row.get("gpu_kind") or "").strip()
        if not kind:
            raise InputError(path, number, "gpu_kind", "empty: name the GPU kind of this pool (e.g. A100)")
        if kind in dict(kinds):
            raise InputError(path, number, "gpu_kind", f"{kind} is listed twice: one row per kind")
        kinds.append((kind, topology))
    if not kinds:
        raise InputError(path, None, None, "no cluster row")
    return MixedTopology.of(kinds)


def cluster_speeds(path: Path) -> dict[str, float]:
    """A mixed cluster file's `relative_speed` per kind, where given: how fast
    a GPU of that kind trains, relative to the others, for a model measured
    on some kinds only (an operator's estimate; the service measures its own)."""
    path = Path(path)
    rows = csv_rows(path)
    _, header = next(rows)
    if "relative_speed" not in header or "gpu_kind" not in header:
        return {}
    speeds: dict[str, float] = {}
    for number, row in rows:
        text = (row.get("relative_speed") or "").strip()
        if not text:
            continue
        try:
            speed = float(text)
        except ValueError:
            raise InputError(path, number, "relative_speed", f"not a number: {text!r}") from None
        if not speed > 0:
            raise InputError(path, number, "relative_speed", f"must be positive, got {text}")
        speeds[(row.get("gpu_kind") or "").strip()] = speed
    return speeds


def load_teams(path: Path) -> tuple["Team", ...]:
    """The teams of a teams file (YAML: `teams:`, a list of `name`, `share`,
    and optional `borrowing_limit` and `lending_limit`, all GPUs)."""
    import yaml
    from pydantic import BaseModel, ConfigDict, Field, ValidationError

    from scheduler_service.policy.teams import Team

    class TeamSpec(BaseModel):
        model_config = ConfigDict(extra="forbid")
        name: str = Field(min_length=1)
        share: int = Field(ge=0)
        borrowing_limit: int | None = Field(None, ge=0)
        lending_limit: int | None = Field(None, ge=0)

    class TeamsFile(BaseModel):
        model_config = ConfigDict(extra="forbid")
        teams: list[TeamSpec] = Field(min_length=1)

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise InputError(path, None, None, f"cannot read: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise InputError(path, None, None, f"not YAML: {str(exc).splitlines()[0]}") from None
    try:
        parsed = TeamsFile.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(part) for part in err["loc"])
        raise InputError(path, None, where or None, err["msg"]) from None
    names = [t.name for t in parsed.teams]
    if len(set(names)) != len(names):
        raise InputError(path, None, "teams", f"team names must be distinct: {names}")
    return tuple(Team(t.name, t.share, t.borrowing_limit, t.lending_limit) for t in parsed.teams)
