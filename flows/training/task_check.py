"""Whether a run's task names what it should, checked in a short-lived
process of its own.

The scheduler never imports a user's code (its process holds the store's
and Prefect's credentials), yet a misspelt loss or dataset found only in
the run's ranks costs a profile and a launch. So take-in (and a flow that
must count a user's dataset to know its length in epochs) starts
`python -m flows.training.task_check`, with the ranks' environment
(standby.rank_env) and, where the operator set one, the ranks' account: it
first finds each module and the name in its source without running the
module, so a typo is refused in about a second, then imports them and
checks what each must be (a function, a dataset, the factory's
arguments); it counts the dataset when asked. The answer is one JSON line
on a descriptor of its own (what the user's code prints goes to stderr):
`{"size": N}` or `{"field": ..., "error": ...}`.

Standard library only until every name is found: the checking process
imports torch (and pydantic) only for what its source cannot tell.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from flows.training.allowlist import check_allowed

# A task whose modules take longer to import is refused: torch alone took
# 15-20 s of wall time on a 2-core machine at a load average of 20-30.
TIMEOUT_S = 120.0


class TaskRefused(ValueError):
    """A name of the task that does not resolve; `str()` starts with its field."""


def user_paths(params: Any) -> dict[str, str]:
    """The task's import paths (a user's code), by parameter."""
    paths = {"model": params.model if ":" in params.model else None,
             "dataset": params.dataset.name if params.dataset is not None and params.dataset.user else None,
             "loss": params.loss if ":" in params.loss else None,
             "collate": params.collate, "evaluate": params.evaluate}
    return {field: path for field, path in paths.items() if path}


def check_task(params: Any, count: bool = False, timeout_s: float = TIMEOUT_S) -> int | None:
    """Refuse (`TaskRefused`, naming the field) a task whose import paths do not
    resolve; with `count`, the length of its user dataset. Nothing is started
    for a task of built-in names only."""
    from flows.training.launch import identity
    from flows.training.launch.standby import REPO_ROOT, rank_env, with_repo_on_path

    paths = user_paths(params)
    count = count and "dataset" in paths
    if not paths:
        return None
    order = {"paths": paths, "model_kwargs": params.model_kwargs, "count": count,
             "dataset": params.dataset.model_dump() if params.dataset is not None else None}
    read, write = os.pipe()
    env = rank_env(dict(os.environ))
    env["OMP_NUM_THREADS"] = "1"
    with_repo_on_path(env)
    account: dict[str, Any] = {}
    user = identity.configured_user()
    if user is not None and os.geteuid() == 0:  # the ranks' account, without any run's group
        found = identity.check_user(user)
        account = {"user": found.pw_uid, "group": found.pw_gid, "extra_groups": []}
    try:
        proc = subprocess.Popen([sys.executable, "-m", "flows.training.task_check", str(write)], env=env,
                                cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, pass_fds=(write,), **account)
    finally:
        os.close(write)
    with os.fdopen(read) as answers:
        try:
            _, err = proc.communicate(json.dumps(order).encode(), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise TaskRefused(f"{', '.join(paths)}: importing {', '.join(paths.values())} took over {timeout_s:.0f} s "
                              "(a module that waits at import?)") from None
        answer = answers.read().strip()
    if not answer:
        tail = err.decode(errors="replace").strip().splitlines()[-3:]
        raise TaskRefused(f"{', '.join(paths)}: the check of the task's import paths ended with code "
                          f"{proc.returncode}: {' / '.join(tail)}")
    reply = json.loads(answer.splitlines()[-1])
    if "error" in reply:
        raise TaskRefused(f"{reply['field']}: {reply['error']}")
    return reply.get("size")


def dataset_size(params: Any) -> int:
    """The length of the run's dataset: a registered one loaded here, a
    user's counted in a process of its own (`check_task`)."""
    if params.dataset.user:
        size = check_task(params, count=True)
        assert size is not None
        return size
    from flows.training.datasets import load_dataset

    return len(load_dataset(params.dataset))


# The checking process.


def _defines(source: str, name: str) -> bool | None:
    """Whether module `source` binds `name` at its top level; None when its
    source cannot tell (a star import, a module `__getattr__`)."""
    tree = ast.parse(source)
    found: set[str] = set()
    unsure = False

    def visit(body: list[ast.stmt]) -> None:
        nonlocal unsure
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.add(node.name)
                unsure |= node.name == "__getattr__"
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    unsure |= alias.name == "*"
                    found.add(alias.asname or alias.name.partition(".")[0])
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    found.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
                for block in ("body", "orelse", "finalbody"):
                    visit(getattr(node, block, []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
    visit(tree.body)
    return True if name in found else None if unsure else False


def _find(path: str) -> str | None:
    """Why `path` names nothing, found without running its module: no such
    module, or a module whose source binds no such name."""
    module_name, _, attr = path.partition(":")
    try:
        spec = importlib.util.find_spec(module_name)  # runs the parent packages' __init__ only
    except Exception as exc:
        return f"cannot import module {module_name!r}: {type(exc).__name__}: {exc}"
    if spec is None:
        return f"no module named {module_name!r}"
    if spec.origin and spec.origin.endswith(".py") and Path(spec.origin).is_file():
        if _defines(Path(spec.origin).read_text(errors="replace"), attr) is False:
            return f"module {module_name!r} has no {attr!r}"
    return None


def _check(order: dict[str, Any]) -> dict[str, Any]:
    paths: dict[str, str] = order["paths"]
    for field, path in paths.items():  # every name first: a typo is refused before anything heavy is imported
        try:
            check_allowed(path, field)
        except ValueError as exc:
            return {"field": field, "error": str(exc)}
        missing = _find(path)
        if missing:
            return {"field": field, "error": missing}
    from flows.training.datasets import DatasetSpec
    from flows.training.rank.task import build_dataset, resolve, resolve_callable

    for field, path in paths.items():
        try:
            if field == "dataset":
                found = resolve(path, field)
                spec = DatasetSpec(**order["dataset"])
                if callable(found) and (spec.options or spec.path):
                    kwargs = dict(spec.options) | ({"path": spec.path} if spec.path else {})
                    _binds(found, kwargs, "dataset.options")
            else:
                found = resolve_callable(path, field)
                if field == "model":
                    _binds(found, order["model_kwargs"], "model_kwargs")
        except ValueError as exc:  # "<field>: <why>"
            named, _, why = str(exc).partition(": ")
            return {"field": named, "error": why}
    if order["count"]:
        try:
            return {"size": len(build_dataset(DatasetSpec(**order["dataset"])))}
        except Exception as exc:
            message = str(exc).removeprefix("dataset: ")
            return {"field": "dataset", "error": f"{type(exc).__name__}: {message}"}
    return {"size": None}


def _binds(function: Any, kwargs: dict[str, Any], field: str) -> None:
    import inspect

    try:
        inspect.signature(function).bind(**kwargs)
    except TypeError as exc:
        raise ValueError(f"{field}: {exc}") from None
    except ValueError:  # no signature to read (a builtin): its call will say
        pass


def main(fd: int) -> None:
    os.umask(0o077)
    os.set_inheritable(fd, False)  # a process the user's code starts does not hold the answer open
    answers = os.fdopen(fd, "w")
    os.dup2(2, 1)  # what the user's modules print is not the answer
    order = json.loads(sys.stdin.read())
    try:
        reply = _check(order)
    except Exception as exc:  # the check itself must answer, whatever the user's code raised
        reply = {"field": ", ".join(order["paths"]), "error": f"{type(exc).__name__}: {exc}"}
    answers.write(json.dumps(reply) + "\n")
    answers.flush()
    sys.stderr.flush()
    os._exit(0)  # not waiting for threads the user's modules may have started


if __name__ == "__main__":
    main(int(sys.argv[1]))
