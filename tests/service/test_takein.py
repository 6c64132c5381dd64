"""Take-in without a server: what can only fail later is refused at once,
naming the field, and the refusal says what the run asked for."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from scheduler_service.contracts import RunPhase
from tests.service.offline import Entry, FlowRun, offline_worker

NOW = 1_800_000_000.0


def _take(worker, parameters: dict) -> str:  # type: ignore[no-untyped-def]
    entry = Entry(FlowRun(parameters))
    asyncio.run(worker.take_in.take([entry], NOW))
    return str(entry.flow_run.id)


def test_a_checkpoint_store_block_nobody_saved_is_refused_before_the_run_holds_a_gpu(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    worker = offline_worker(tmp_path, monkeypatch)
    run_id = _take(worker, {"model": "mlp", "iterations": 5, "checkpoint_store": "team-store"})
    (decision,) = worker.reporter.store.decisions(run_id)
    assert not decision.admitted and decision.reason == "invalid_parameters"
    assert decision.message.startswith("checkpoint_store: no CheckpointStore block named 'team-store' is saved")
    (row,) = worker.reporter.store.jobs()
    assert row.status == RunPhase.REJECTED and row.model == "mlp"  # shown as what it asked for, rejected


def test_cuda_asked_of_this_cpu_cluster_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    worker = offline_worker(tmp_path, monkeypatch)
    run_id = _take(worker, {"model": "mlp", "iterations": 5, "device": "cuda"})
    (decision,) = worker.reporter.store.decisions(run_id)
    assert decision.reason == "invalid_parameters" and decision.message.startswith("device: 'cuda' was asked")


def test_new_runs_wait_in_the_queue_while_prefects_server_is_far_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 29, 2: decisions are told to Prefect in the background; once that
    many are still untold, take-in leaves new runs Scheduled in the queue
    (decided now, an admitted one would start when its decision is written,
    later than planned) and takes them in once the server caught up."""
    import anyio

    from scheduler_service.worker.reporting import Reporter
    from scheduler_service.worker.takein import TakeIn
    from tests.service.offline import OfflineClient, RecordingPublisher

    class Stuck(RecordingPublisher):
        """A server that takes no write until told to."""

        def __init__(self) -> None:
            super().__init__()
            self.go = anyio.Event()

        async def rejected(self, run_id: str, rejection: object) -> None:
            await self.go.wait()
            await super().rejected(run_id, rejection)

    worker = offline_worker(tmp_path, monkeypatch)
    entries = [Entry(FlowRun({"model": "no-such-model"})) for _ in range(40)]

    async def scenario() -> tuple[int, int, int]:
        publisher = Stuck()
        async with anyio.create_task_group() as group:
            reporter = Reporter(worker.reporter.store, publisher, lambda flow_run: worker._logger, lambda: group,
                                concurrency=4)  # 16 untold at most
            take_in = TakeIn(OfflineClient(), worker.settings, worker.registry, worker.loop, worker.profiler,
                             reporter, lambda: "cpu")
            first, _ = await take_in.take(entries, NOW)
            again, _ = await take_in.take(entries, NOW)  # still behind: nothing more
            publisher.go.set()
            while reporter.untold:
                await anyio.sleep(0.01)
            rest, _ = await take_in.take(entries, NOW)
        return first, again, rest

    first, again, rest = asyncio.run(scenario())
    assert (first, again) == (16, 0)
    assert rest == 24 and len(worker.reporter.store.decisions()) == 40


@pytest.mark.parametrize("variables, named", [
    ({"command": "sh -c 'id > pwned.txt'"}, "'command'"),
    ({"env": {"PYTHONPATH": "evil"}}, "'env'"),
    ({"env.PYTHONPATH": "evil"}, "'env'"),
    ({"working_dir": "/tmp", "stream_output": True}, "'working_dir'"),
])
def test_a_run_whose_job_variables_reach_past_its_model_is_refused_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variables: dict, named: str) -> None:
    """Issue 43: `--job-variable command=...` or `env={"PYTHONPATH": ...}` ran
    code of the user's choosing as the stack's user; now the run is rejected
    before anything of it starts, naming the variable."""
    worker = offline_worker(tmp_path, monkeypatch)
    entry = Entry(FlowRun({"model": "mlp", "iterations": 5}, job_variables=variables))
    took_in, launch = asyncio.run(worker.take_in.take([entry], NOW))
    run_id = str(entry.flow_run.id)
    (decision,) = worker.reporter.store.decisions(run_id)
    assert not decision.admitted and decision.reason == "invalid_parameters"
    assert decision.message.startswith("job_variables: ") and named in decision.message
    assert worker.registry.get(run_id) is None and not launch and worker.loop.view(run_id, NOW) is None


def test_a_deployment_whose_job_variables_set_the_environment_has_its_runs_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.service.offline import OfflineClient

    worker = offline_worker(tmp_path, monkeypatch)
    worker.take_in.client = OfflineClient(deployments={"d1": {"env": {"PYTHONPATH": "evil"}}, "d2": {}})
    bad = Entry(FlowRun({"model": "mlp", "iterations": 5}, deployment_id="d1"))
    good = Entry(FlowRun({"model": "mlp", "iterations": 5}, job_variables={"stream_output": True},
                         deployment_id="d2"))
    asyncio.run(worker.take_in.take([bad, good], NOW))
    (decision,) = worker.reporter.store.decisions(str(bad.flow_run.id))
    assert "'env' in its deployment's job variables" in decision.message
    assert worker.registry.get(str(good.flow_run.id)) is not None  # a variable a user may set is fine


def test_the_pool_offers_no_variable_that_reaches_past_the_model_and_the_launch_drops_them() -> None:
    """Defence in depth: whatever a pool made before this rule templates in,
    a run's command, environment and working folder never come from job variables."""
    import anyio
    from prefect.workers.process import ProcessWorker

    from scheduler_service.worker.configuration import ElasticFlowJobConfiguration
    from scheduler_service.worker.worker import ElasticFlowWorker

    template = ElasticFlowWorker.get_default_base_job_template()
    assert set(template["variables"]["properties"]) == {"stream_output"}
    assert template["variables"]["additionalProperties"] is False
    assert set(template["job_configuration"]) == {"stream_output"}
    old_pool = ProcessWorker.get_default_base_job_template()  # offers command, env, working_dir
    values = {"command": "sh -c 'id > pwned.txt'", "env": {"PYTHONPATH": "evil"}, "env.LD_PRELOAD": "x.so",
              "working_dir": "/tmp", "stream_output": True}
    from tests.service.offline import OfflineClient

    configuration = anyio.run(ElasticFlowJobConfiguration.from_template_and_values, old_pool, values, OfflineClient())
    assert configuration.command is None and configuration.env == {} and configuration.working_dir is None
    assert configuration.stream_output is True
    from scheduler_service.worker.configuration import confined

    fixed = confined(old_pool)  # what `up` makes of a pool made before the rule (ensure_pool)
    assert set(fixed["variables"]["properties"]) == {"stream_output"}
    assert fixed["variables"]["additionalProperties"] is False
    assert not {"command", "env", "working_dir"} & set(fixed["job_configuration"])
    assert confined(template) == template  # a pool made now is left as it is


@pytest.mark.parametrize("parameters, field", [
    ({"iterations": None}, "iterations"),  # `--param iterations=NaN` through Prefect's CLI
    ({"epochs": None}, "epochs"),
    ({"iterations": 5, "checkpoint_interval": None}, "checkpoint_interval"),
    ({"iterations": 5, "max_restarts": None}, "max_restarts"),
    ({"iterations": 5, "hyperparameters": {"max_micro_batch": None}}, "hyperparameters.max_micro_batch"),
    ({"iterations": 5, "hyperparameters": {"learning_rate": None}}, "hyperparameters.learning_rate"),
    ({"iterations": float("nan")}, "iterations"),
    ({"epochs": float("inf")}, "epochs"),
    ({"iterations": 5, "hyperparameters": {"momentum": float("nan")}}, "hyperparameters.momentum"),
])
def test_a_number_that_is_null_nan_or_infinite_is_refused_naming_the_field(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, parameters: dict, field: str) -> None:
    """Issue 43: `--param iterations=NaN` reached take-in as null, the run
    trained its default length and reported its deadline met."""
    worker = offline_worker(tmp_path, monkeypatch)
    run_id = _take(worker, {"model": "mlp", **parameters})
    (decision,) = worker.reporter.store.decisions(run_id)
    assert not decision.admitted and decision.reason == "invalid_parameters"
    assert decision.message.startswith(f"{field}: "), decision.message


def test_prefects_cli_sends_nan_as_null() -> None:
    """What the test above stands for: the CLI reads `NaN` as JSON (a float
    nan) and the client sends it as null."""
    from prefect.cli._utilities import load_json_key_values
    from prefect.client.schemas.actions import DeploymentFlowRunCreate

    parameters = load_json_key_values(["iterations=NaN", "epochs=Infinity"], "parameter")
    sent = DeploymentFlowRunCreate(parameters=parameters).model_dump(mode="json")["parameters"]
    assert sent == {"iterations": None, "epochs": None}


FORGED = "ok\n12:00:00 | INFO | finished: met\x1b[2J\u202eevil\u200b"
ESCAPED = "ok\\n12:00:00 | INFO | finished: met\\x1b[2J\\u202eevil\\u200b"


def test_a_forged_name_is_kept_escaped_in_prefect_the_store_and_every_log_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 43: a run's name forged lines in worker.log (a raw newline, a
    fake `finished: met`, ESC[2J) and hid itself with U+202E and U+200B."""
    import io
    import logging

    from scheduler_service.store import save_curve
    from scheduler_service.text import one_line_logs

    worker = offline_worker(tmp_path, monkeypatch)
    save_curve("mlp", 32, {1: 50.0, 2: 90.0})
    logger = logging.getLogger("prefect.workers.elasticflow")
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s | %(flow_run_name)s | %(message)s", defaults={
        "flow_run_name": "-"}))
    logger.addHandler(handler)
    try:
        one_line_logs(logger)
        flow_run = FlowRun({"model": "mlp", "iterations": 5})
        flow_run.name = FORGED
        entry = Entry(flow_run)
        asyncio.run(worker.take_in.take([entry], NOW))
        asyncio.run(worker.decide(NOW))
        logger.info("flow run %s finished", FORGED, extra={"flow_run_name": FORGED})
        logger.info(FORGED)  # a message that is itself the name, with no arguments
    finally:
        logger.removeHandler(handler)
    run_id = str(flow_run.id)
    assert worker.take_in.client.renamed == {run_id: ESCAPED} and flow_run.name == ESCAPED
    (row,) = worker.reporter.store.jobs()
    assert row.flow_run_name == ESCAPED and worker.registry.get(run_id).name == ESCAPED
    (decision,) = worker.reporter.store.decisions(run_id)
    assert decision.admitted  # and decided as any other run
    text = out.getvalue()
    assert not set("\x1b\u202e\u200b") & set(text)
    assert all(line.startswith(("INFO", "WARNING")) for line in text.splitlines()), text
    assert f"INFO | {ESCAPED} | flow run {ESCAPED} finished" in text.splitlines()


def test_a_one_megabyte_name_is_taken_in_bounded_and_decided(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 43: a 10 MB name crashed its run in Prefect (EventTooLarge) while
    the store kept its GPUs; the name Prefect, the store and the events get is bounded."""
    from scheduler_service.store import save_curve
    from scheduler_service.text import NAME_LIMIT

    worker = offline_worker(tmp_path, monkeypatch)
    save_curve("mlp", 32, {1: 50.0, 2: 90.0})
    flow_run = FlowRun({"model": "mlp", "iterations": 5})
    flow_run.name = "B" * (1 << 20)
    asyncio.run(worker.take_in.take([Entry(flow_run)], NOW))
    asyncio.run(worker.decide(NOW))
    run_id = str(flow_run.id)
    (decision,) = worker.reporter.store.decisions(run_id)
    assert decision.admitted
    (row,) = worker.reporter.store.jobs()
    assert len(row.flow_run_name) == NAME_LIMIT and row.flow_run_name.endswith("…")
    assert len(worker.take_in.client.renamed[run_id]) == NAME_LIMIT and len(flow_run.name) == NAME_LIMIT


def test_huge_parameters_and_messages_quoting_them_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from scheduler_service.text import MESSAGE_LIMIT

    worker = offline_worker(tmp_path, monkeypatch)
    big = _take(worker, {"model": "mlp", "iterations": 5, "model_kwargs": {"x": "y" * (1 << 20)}})
    (decision,) = worker.reporter.store.decisions(big)
    assert decision.message.startswith("parameters: ") and "more than the 65536" in decision.message
    quoted = _take(worker, {"model": "mlp", "iterations": 5, "checkpoint_store": "/" + "\n" * 5000})
    (decision,) = worker.reporter.store.decisions(quoted)
    assert "\n" not in decision.message and len(decision.message) <= MESSAGE_LIMIT + 100


def test_a_run_taken_without_a_guarantee_is_not_named_admitted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 46: a best-effort run's state was named Admitted, which reads as a promise."""
    from scheduler_service.store import save_curve

    worker = offline_worker(tmp_path, monkeypatch)
    save_curve("mlp", 32, {1: 50.0, 2: 90.0})
    due = _take(worker, {"model": "mlp", "iterations": 5, "deadline": "+1h"})
    whenever = _take(worker, {"model": "mlp", "iterations": 5})
    asyncio.run(worker.decide(NOW))
    asyncio.run(worker.reporter.drain(timeout_s=5.0))
    named = worker.reporter.publisher.named
    assert (named[due][0], named[whenever][0]) == ("Admitted", "Best-effort")
