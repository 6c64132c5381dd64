"""Whose code a run may name: the operator's allow-list of module prefixes
for every import path (model factory, dataset, loss, collate, evaluation),
checked without importing anything.

Standard library only: the scheduler and the take-in check's process import
it before anything heavy.
"""

from __future__ import annotations

import os
import re


def is_import_path(name: str) -> bool:
    return ":" in name


# The operator's list of module prefixes users' code may come from, for every
# import path a run names (model factory, dataset, loss, collate,
# evaluation), comma-separated (e.g. "acme.models,research"); empty, only the
# built-in models and the shipped examples run. A factory is code run in the
# training processes: `os:system` with `model_kwargs={"command": ...}` ran a
# shell command there.
MODEL_MODULES_ENV = "ELASTICFLOW_MODEL_MODULES"
# Shipped with the platform (flows/examples): as trusted as the built-in models.
BUILT_IN_MODULES = ("flows.examples",)
_IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")


def allowed_model_modules() -> tuple[str, ...]:
    return tuple(p.strip() for p in os.environ.get(MODEL_MODULES_ENV, "").split(",") if p.strip())


def check_allowed(name: str, what: str = "model") -> None:
    """A `pkg.module:name` path must lie under a prefix the operator allowed
    (or the shipped examples'); checked without importing anything (the
    scheduler never imports user code)."""
    module_name = name.partition(":")[0]
    allowed = allowed_model_modules()
    if not any(module_name == prefix or module_name.startswith(prefix + ".") for prefix in allowed + BUILT_IN_MODULES):
        listed = ", ".join(allowed) if allowed else "empty: built-in models only, and the shipped flows.examples"
        raise ValueError(f"{what} module {module_name!r} is not one the operator allows ({MODEL_MODULES_ENV}: "
                         f"{listed})")


def check_import_path(value: str, what: str) -> str:
    """`value` has the shape `pkg.module:name` and lies under an allowed
    module: what can be checked without importing it."""
    if not _IMPORT_PATH.match(value):
        raise ValueError(f"{what} {value!r} is not a 'pkg.module:name' import path")
    check_allowed(value, what)
    return value
