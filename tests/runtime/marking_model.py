"""A user model module whose import leaves a mark: `imported-<pid>` in the
folder `ELASTICFLOW_TEST_MARKS` names, in whichever process imports it (the
ranks may not see that variable: their environment is the least they need)."""

import os
from pathlib import Path

from torch import nn

if os.environ.get("ELASTICFLOW_TEST_MARKS"):
    (Path(os.environ["ELASTICFLOW_TEST_MARKS"]) / f"imported-{os.getpid()}").touch()


def marked(features: int = 32, classes: int = 10) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(features, classes))
