"""Which layer may import what, checked after a real import in a fresh interpreter.

The store, the scheduling core and the pipeline's deadline logic are imported
by the worker, the CLI and users' pipelines: pulling torch in costs seconds on
every start (issue 11). The policy is pure: no Prefect, no database.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

NO_TORCH = [
    "scheduler_service.store",
    "scheduler_service.policy",
    "elasticflow_block",
    "elasticflow_block.deadline",
    "elasticflow_block.pipeline",
    "flows.training.task_check",  # its process finds a task's names before anything heavy is imported
]
PURE = {"scheduler_service.policy": ["prefect", "sqlmodel", "sqlalchemy"]}


def _loaded(module: str) -> set[str]:
    """Every module in sys.modules after importing `module` in a fresh interpreter."""
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout))


def _imported(module: str) -> set[str]:
    """The top-level packages importing `module` loads."""
    return {name.split(".")[0] for name in _loaded(module)}


@pytest.mark.parametrize("module", NO_TORCH)
def test_imports_no_torch(module: str) -> None:
    assert "torch" not in _imported(module)


@pytest.mark.parametrize("module,forbidden", sorted(PURE.items()))
def test_policy_is_pure(module: str, forbidden: list[str]) -> None:
    assert not set(forbidden) & _imported(module)


def test_the_worker_reads_its_cluster_file_without_the_simulator() -> None:
    assert not {m for m in _loaded("scheduler_service.worker.cluster") if m.startswith("scheduler_service.simulator")}


def _imports_of(package: Path) -> set[str]:
    """Top-level packages named by any import in the package, lazy ones included."""
    found: set[str] = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module.split(".")[0])
    return found


def test_elasticflow_block_does_not_import_flows() -> None:
    """`flows` builds on `elasticflow_block` (storage, home, the block), never the reverse."""
    assert "flows" not in _imports_of(ROOT / "elasticflow_block")


def _modules_named(package: Path) -> set[str]:
    """Every module named by an import in the package, lazy ones included, in full;
    for `from X import Y` also `X.Y`, as Y may be a module (`from flows.training.rank import rank`)."""
    found: set[str] = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module)
                found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


@pytest.mark.parametrize("package", ["simulator", "loop"])
def test_the_simulator_and_the_loop_import_nothing_from_the_worker(package: str) -> None:
    """Issue 42: the simulator imported the worker package to read one
    default. What the loop decides with has one home (LoopSettings); the
    worker's settings and the simulator both read it there."""
    named = _modules_named(ROOT / "scheduler_service" / package)
    assert not {m for m in named if m.startswith("scheduler_service.worker")}


def test_nothing_below_the_cli_imports_it() -> None:
    """Issue 46: the stack's audit read the run views from `cli/status.py`,
    the one import that ran back up the layers; the read model is below both."""
    for package in ("stack", "worker", "loop", "store"):
        named = _modules_named(ROOT / "scheduler_service" / package)
        assert not {m for m in named if m.startswith("scheduler_service.cli")}, package
    assert not {m for m in _loaded("scheduler_service.readmodel")
                if m.split(".")[0] == "prefect" or m.startswith(("scheduler_service.worker", "scheduler_service.policy",
                                                                   "torch", "numpy"))}


def test_each_class_name_means_one_thing() -> None:
    """Issue 46: `Cluster`, `Outcome`, `Placement`, `RunView`, `Stop`, `Job`,
    `GpuSlot`, `Run` and more each named two different things (and `Released`
    and `Release` two close ones); a reader who met one took it for the other."""
    defined: dict[str, list[str]] = {}
    for package in ("scheduler_service", "flows", "elasticflow_block"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                    defined.setdefault(node.name, []).append(str(path.relative_to(ROOT)))
    assert not {name: where for name, where in defined.items() if len(where) > 1}


TRAINING = ROOT / "flows" / "training"


def _within(named: set[str], *layers: str) -> set[str]:
    """The names that are one of the layer packages or a module in one."""
    packages = [f"flows.training.{layer}" for layer in layers]
    return {m for m in named for p in packages if m == p or m.startswith(p + ".")}


@pytest.mark.parametrize("layer", ["launch", "coordinator", "rank", "reporting"])
def test_each_layer_is_a_package(layer: str) -> None:
    """Issue 45: `flows/training/` was one flat folder of four layers; each is now a folder."""
    assert (TRAINING / layer / "__init__.py").is_file()


def test_the_worker_does_not_import_the_rank() -> None:
    """Issue 45: the worker starts a run's processes with the launch layer
    (and reads the shared modules: parameters, control channel); the rank's
    modules, where a user's code runs, are never its imports."""
    named = _modules_named(ROOT / "scheduler_service" / "worker")
    assert not _within(named, "rank")


def test_the_rank_imports_neither_the_coordinator_nor_prefect_glue() -> None:
    """A rank reads what the coordinator tells it through the shared modules
    (segment, orders, regroup, supervision, control), never the coordinator itself."""
    assert not _within(_modules_named(TRAINING / "rank"), "coordinator", "reporting")


def test_launch_is_the_bottom_layer() -> None:
    """The launch layer names the rank's entry (and the flow) only to start or
    warm them; it imports nothing of the coordinator or the Prefect glue."""
    assert not _within(_modules_named(TRAINING / "launch"), "coordinator", "reporting")


def test_the_coordinator_runs_without_prefect_glue() -> None:
    assert not _within(_modules_named(TRAINING / "coordinator"), "reporting")


def test_no_module_of_the_training_runtime_is_over_400_lines() -> None:
    """Issue 45: over ~400 lines a module holds two concerns; the runtime,
    which users' code runs in, stays readable module by module."""
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "flows").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long
