"""Where ElasticFlow keeps its state on this machine: `$ELASTICFLOW_HOME`,
default `~/.elasticflow` (store, control channels, checkpoints, registry,
logs). One definition, read at call time so tests and CLIs can set it."""

from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "ELASTICFLOW_HOME"


def elasticflow_home() -> Path:
    return Path(os.environ.get(HOME_ENV) or Path.home() / ".elasticflow")
