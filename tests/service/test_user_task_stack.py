"""The example tasks through the service (issue 45): `train/regression` and
`train/causal-lm` deployed from prefect.yaml's definitions, submitted as a
user would (`prefect deployment run train/<name> --param deadline=...`),
admitted and trained to completion; a misspelt loss is Rejected before any
profile, naming the field."""

from __future__ import annotations

import pytest

from tests.service.conftest import POOL, Stack

pytestmark = pytest.mark.slow

EXAMPLES = {"regression": "flows.examples.regression:model", "causal-lm": "flows.examples.causal_lm:build"}


def test_the_example_tasks_train_through_the_service_and_a_typo_is_refused(stack: Stack) -> None:
    from prefect.deployments import run_deployment

    from scheduler_service.stack.deployments import deploy
    from scheduler_service.store import save_curve

    for model in EXAMPLES.values():  # seeded, as the MLP's: decided at once, no profile
        save_curve(model, 32, {1: 20.0, 2: 36.0})
    deploy(POOL, list(EXAMPLES), parameters={"device": "cpu"})
    runs = {name: str(run_deployment(f"train/{name}", parameters={"iterations": 12, "deadline": "+10m"},
                                     timeout=0).id)  # type: ignore[union-attr]
            for name in EXAMPLES}
    typo = str(run_deployment("train/regression", timeout=0,  # type: ignore[union-attr]
                              parameters={"iterations": 12, "deadline": "+10m",
                                          "loss": "flows.examples.regression:mes"}).id)
    refused = stack.wait_final(typo, 60)
    assert refused.state.name == "Rejected"
    assert refused.state.message == ("invalid_parameters: loss: module 'flows.examples.regression' has no 'mes'")
    for name, run_id in runs.items():
        run = stack.wait_final(run_id, 240)
        assert run.state.type.value == "COMPLETED", (name, run.state)
