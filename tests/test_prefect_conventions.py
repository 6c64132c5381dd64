"""What a Prefect user expects of the project: `prefect deploy --all` reads
prefect.yaml, and the CheckpointStore block is in the server's catalogue
before anyone saves one (issue 11)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _prefect_yaml() -> list[dict]:
    """The deployments as `prefect deploy` loads them (its own loader and model)."""
    from prefect.cli.deploy._config import _load_deploy_configs_and_actions
    from rich.console import Console

    configs, _ = _load_deploy_configs_and_actions(ROOT / "prefect.yaml", console=Console(quiet=True))
    return configs


def test_prefect_yaml_declares_train_per_model_and_the_daily_pipeline() -> None:
    from scheduler_service.stack.deployments import MODELS

    configs = _prefect_yaml()
    trains = [c for c in configs if c["entrypoint"] == "flows.train.train"]
    assert sorted(c["name"] for c in trains) == sorted(MODELS)
    models = [c for c in trains if ":" not in c["parameters"]["model"]]
    assert all(c["parameters"] == {"model": c["name"]} for c in models)
    assert all(c["work_pool"]["name"] == "gpus" for c in trains)
    tasks = {c["name"]: c["parameters"] for c in trains if c not in models}  # example tasks, by import path
    assert tasks["regression"]["loss"] == "flows.examples.regression:mse" and tasks["causal-lm"]["loss"] == "model"
    from flows.training.params import TrainParameters

    for parameters in tasks.values():  # what `prefect deployment run train/<name>` submits is a valid run
        TrainParameters.model_validate(parameters, context={"import_models": False})
    (daily,) = [c for c in configs if c["name"] == "daily"]
    assert daily["entrypoint"] == "flows.pipeline.daily_pipeline" and daily["work_pool"]["name"] == "gpus"


def test_the_example_trigger_is_a_valid_deployment_trigger_on_the_at_risk_event() -> None:
    from prefect.events.schemas.deployment_triggers import DeploymentTriggerTypes
    from pydantic import TypeAdapter

    (daily,) = [c for c in _prefect_yaml() if c["name"] == "daily"]
    (trigger,) = [TypeAdapter(DeploymentTriggerTypes).validate_python(t) for t in daily["triggers"]]
    assert trigger.expect == {"elasticflow.deadline.at-risk"} and not trigger.enabled


@pytest.mark.slow
def test_the_checkpoint_store_block_is_registered_through_the_entry_point(prefect_api: str) -> None:
    """The server imports the `prefect.collections` entry points at start-up
    and registers every block class they define."""
    from elasticflow_block.prefect_client import sync_client

    with sync_client() as client:
        block_type = client.read_block_type_by_slug("elasticflow-checkpoint-store")
    assert block_type.name == "ElasticFlow Checkpoint Store"


def test_sync_clients_share_one_tls_context_and_still_follow_the_tls_settings() -> None:
    """Prefect loads the CA bundle for every client it makes (25 ms of CPU);
    the project's polls make one a few times a second, so the context is
    kept, but a changed setting is honoured."""
    import ssl

    from prefect.settings import PREFECT_API_SSL_CERT_FILE, PREFECT_API_TLS_INSECURE_SKIP_VERIFY, temporary_settings

    from elasticflow_block.prefect_client import _tls, sync_client

    _tls.cache_clear()
    sync_client(), sync_client()
    assert (_tls.cache_info().misses, _tls.cache_info().hits) == (1, 1)
    with temporary_settings(updates={PREFECT_API_TLS_INSECURE_SKIP_VERIFY: True}):
        sync_client()
        insecure = _tls(PREFECT_API_SSL_CERT_FILE.value(), True)
    assert _tls.cache_info().misses == 2
    assert insecure.verify_mode == ssl.CERT_NONE and not insecure.check_hostname
