"""What a user sees in the Prefect UI, checked in a real browser: a Rejected run
shows its reason, an admitted run shows its allocation-history artifact, and a
markdown artifact with the allocation plot as a `data:` URI image renders.
The runs behind those pages are played once (a run shrunk in place for an
urgent one among them, tests/scenarios.py), and what the service recorded of
them is checked here too, browser or not.

The shared stack's server does not serve the UI, so this module starts its
own stack (tests/stack.py's `running_stack`) with the UI on. Headless Chromium comes from the distribution
(`infra/ensure-chromium.sh`), driven by Playwright's Python package; Playwright
never downloads a browser here.

ELASTICFLOW_SAVE_SCREENSHOTS=1 writes the screenshots to docs/img/ (else to the
test's temporary folder, so normal runs leave the tree alone).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from scheduler_service.worker.render import short_name
from tests.scenarios import Shrink, shrink_for_an_urgent_run
from tests.stack import ROOT, Stack, running_stack

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ui")]  # one worker: its stack and browser start once

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
SAVE_ENV = "ELASTICFLOW_SAVE_SCREENSHOTS"
CLUSTER_KEY = "elasticflow-cluster"
# A team's real run names are long: the cluster view must fit 1280 px with one (issue 46).
LONG_NAME = "nightly-retrain-resnet50-imagenet-subset-team-vision-2026-12"
assert len(LONG_NAME) >= 60


def find_chromium() -> str | None:
    """A Chromium from $ELASTICFLOW_CHROMIUM or the PATH; installed with
    infra/ensure-chromium.sh (apt-get, as root) when there is none."""
    chosen = os.environ.get("ELASTICFLOW_CHROMIUM")
    if chosen:
        return chosen if os.access(chosen, os.X_OK) else None
    for attempt in range(2):
        for name in CHROMIUM_NAMES:
            path = shutil.which(name)
            if path:
                return path
        if attempt == 0:
            subprocess.run(["sh", str(ROOT / "infra" / "ensure-chromium.sh")], check=False, timeout=600)
    return None


@dataclass
class UiStack:
    stack: Stack
    ui_url: str  # the server's root: the UI
    shots: Path  # where screenshots go


# The stack and its runs for the whole session of the worker that runs these:
# xdist may hand this group's tests over in two parts, and a module's
# fixtures are made again for the second (a minute of the suite, twice). The
# browser stays module-scoped: its event loop must not outlive these tests.
@pytest.fixture(scope="session")
def ui_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UiStack]:
    base = tmp_path_factory.mktemp("ui")
    with running_stack(base, ui=True) as stack:
        shots = ROOT / "docs" / "img" if os.environ.get(SAVE_ENV) == "1" else base / "screenshots"
        shots.mkdir(parents=True, exist_ok=True)
        yield UiStack(stack, stack.api_url.removesuffix("/api"), shots)


@pytest.fixture(scope="module")
def browser(ui_stack: UiStack) -> Iterator[Any]:
    """Only the pages need it: the service's records of the same runs are checked without one."""
    pytest.importorskip("playwright", reason="playwright is not installed (pip install -e '.[dev]')")
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("no Chromium found or installable (root and apt-get needed; see infra/ensure-chromium.sh)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1440, "height": 1000})
    page = context.new_page()
    try:
        yield page
    finally:
        context.close()


def wait_text(page: Any, text: str, timeout_s: float = 30.0) -> None:
    """Wait until the page shows `text`; on failure say what it did show."""
    try:
        page.get_by_text(text, exact=False).first.wait_for(state="visible", timeout=timeout_s * 1000)
    except Exception as exc:
        body = page.inner_text("body")[:3000]
        raise AssertionError(f"{text!r} not shown on {page.url} within {timeout_s} s; the page shows:\n{body}") from exc


@dataclass
class Runs:
    rejected: str
    rejected_message: str
    admitted: str
    admitted_name: str
    cluster_artifact: str  # id of the keyed cluster-view artifact
    resized: str  # a run that shrank in place for an urgent one
    resized_head: list[str]  # the first lines of its log, as its page lists them (oldest first)
    shrink: Shrink  # what the service recorded of the resized run and the one it shrank for


def _cluster_artifact(stack: Stack, run: Any) -> str:
    """The cluster view the worker keeps current: one keyed markdown artifact,
    created once and then updated in place (an update adds no version). Waits
    for the version that lists the admitted run as finished."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from elasticflow_block.prefect_client import sync_client

    def published() -> str | None:
        with sync_client() as client:
            found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[CLUSTER_KEY])))
        for artifact in found:
            if short_name(run.name) in str(artifact.data) and "met" in str(artifact.data):
                return str(artifact.id)
        return None

    return stack.wait_until(published, 60, "the worker's cluster artifact to list the finished run")


@pytest.fixture(scope="session")
def runs(ui_stack: UiStack) -> Runs:
    """One run rejected, one admitted and completed, and the cluster artifact,
    before any browser starts: Playwright's sync API runs an event loop in this
    thread, under which Prefect's sync-or-async functions return coroutines."""
    stack = ui_stack.stack
    rejected = stack.submit(iterations=10**7, deadline="+60s")
    admitted = stack.submit(name=LONG_NAME, iterations=300, deadline="+10m", checkpoint_interval=500)
    rejected_run = stack.wait_final(rejected, 90)
    assert rejected_run.state.name == "Rejected", rejected_run.state
    admitted_run = stack.wait_final(admitted, 180)
    assert admitted_run.state.is_completed(), admitted_run.state
    # the worker records the release when it sees the flow process exit, just after Completed
    stack.wait_until(lambda: "| release |" in stack.allocation_artifact(admitted), 30, "the release in the history")
    cluster_artifact = _cluster_artifact(stack, stack.flow_run(admitted))
    # A long run alone on both slots, then one that must start now: the first shrinks in place
    # (its records: the test right below).
    shrink = shrink_for_an_urgent_run(stack)
    resized = shrink.first

    def idle_view() -> bool:  # the worker rewrites the view once it has seen both processes exit
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

        from elasticflow_block.prefect_client import sync_client

        with sync_client() as client:
            found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[CLUSTER_KEY])))
        return any("0/2 GPUs busy" in str(a.data) for a in found)

    stack.wait_until(idle_view, 60, "the cluster view to show every GPU free")
    head = stack.wait_until(lambda: _log_head(resized, "ElasticFlow: cancelled at"), 60, "the resized run's outcome")
    return Runs(rejected, rejected_run.state.message, admitted, admitted_run.name, cluster_artifact, resized, head,
                shrink)


def _log_head(run_id: str, last: str, lines: int = 15) -> list[str] | None:
    """The run's first `lines` log messages once one contains `last` (the
    outcome is told in the background, after the final state)."""
    import uuid

    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    from elasticflow_block.prefect_client import sync_client

    with sync_client() as client:
        found = [log.message for log in client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[uuid.UUID(run_id)])),
            sort=LogSort.TIMESTAMP_ASC, limit=200)]
    return found[:lines] if any(last in line for line in found) else None


def test_a_resized_runs_story_is_in_the_first_lines_of_its_page(runs: Runs) -> None:
    """Issue 46: a 150-iteration run's page had 130 log lines, 97 of them
    progress; the decision, the resizes and the outcome were buried. Its
    progress is an artifact and labels; the log is what a person acts on:
    none of the runtime's own lines (a run key, a port, a command's seq),
    and no pull step (the deployments import the installed package): CI
    found the outcome at line 21, behind 8 lines of pull steps, at launch
    and again as Prefect loaded the flow for its cancellation hooks."""
    head = "\n".join(runs.resized_head)
    for said in ("ElasticFlow: admitted with a minimum satisfactory share", "ElasticFlow: launched on 2 GPUs",
                 "ElasticFlow: resized: now on 1 GPU", "ElasticFlow: cancelled at"):
        assert said in head, f"{said!r} not in the first {len(runs.resized_head)} lines:\n{head}"
    assert "run_key=" not in head and "run key" not in head, head
    assert "pull step" not in head, head


def test_an_admitted_run_takes_both_slots_and_a_second_arrival_shrinks_it_in_place(runs: Runs) -> None:
    """What the service recorded of the run the pages above show resized
    (tests/scenarios.py): alone it was placed on both slots; a malformed
    arrival was rejected without touching it; the urgent run took one of its
    slots, never the one it kept, and completed; the first shrank in place
    inside the same flow run. No browser needed: this runs where Chromium
    cannot. (A run resized in place training on to its end:
    tests/runtime/test_resize_in_place.py, and through the service
    test_teams_stack.py and the Ray stack test.)"""
    seen = runs.shrink
    assert seen.first_gpus_alone == [0, 1]  # alone: both slots, where it was placed
    # Whether this start was slow enough for the start-cost warning depends on the
    # machine (a warm fork server starts a run in under the 2.5 s charged, a loaded
    # one in several): tests/loop/test_start_cost.py checks the warning itself.
    assert seen.first_allocations_alone[0] == ("launch", "0,1")
    assert seen.first_labels["elasticflow.mss"] == "1" and seen.first_labels["elasticflow.world_size"] == "2"
    (decision,) = seen.decision_events
    assert decision["payload"]["admitted"] is True and decision["payload"]["mss"] == 1
    assert seen.malformed_state.type.value == "CANCELLED" and seen.malformed_state.name == "Rejected"
    assert seen.malformed_state.message.startswith("invalid_parameters: iterations:")
    assert seen.urgent_state.is_completed(), seen.urgent_state
    urgent_launch = next(gpus for action, gpus in seen.urgent_allocations if action == "launch")
    assert [int(urgent_launch)] != seen.shrunk_to  # never on the slot the first one kept
    assert "rescale" in [action for action, _ in seen.first_allocations]
    assert seen.first_final_state.is_cancelled()
    for action in ("admitted", "launch", "rescale", "release"):
        assert f"| {action} |" in seen.history
    assert short_name(seen.first_name) in seen.cluster and "data:image/png;base64," in seen.cluster  # jobs, plot
    names = seen.first_state_names
    assert names[:2] == ["Scheduled", "Admitted"] and names[-1] == "Cancelled"
    assert names.count("Pending") == 1  # one flow run throughout: the resize happened inside it
    rescaling = names.index("Rescaling")  # shown while it checkpoints and moves, then back to Running
    assert names[rescaling + 1] == "Running"


def open_tab(page: Any, name: str) -> None:
    """The run page's tabs are buttons; `?tab=` in the URL is not honoured."""
    wait_text(page, name)
    page.get_by_text(name, exact=True).first.click()


def test_a_rejected_run_shows_its_reason(runs: Runs, ui_stack: UiStack, page: Any) -> None:
    """The state badge says Rejected; the reason is the state message, which the
    3.9.1 UI shows in the Details tab only (truncated behind "See More"). It
    leads with the sentence in plain words, then the policy's reason."""
    reason = "infeasible_even_on_an_idle_cluster"
    assert runs.rejected_message.startswith("This run needs about") and f" — {reason}: " in runs.rejected_message
    page.goto(f"{ui_stack.ui_url}/runs/flow-run/{runs.rejected}")
    wait_text(page, "Rejected")
    open_tab(page, "Details")
    wait_text(page, "State Message")
    wait_text(page, "This run needs about")
    more = page.get_by_text("See More", exact=True)
    if more.count():
        more.first.click()
    wait_text(page, reason)
    wait_text(page, "earliest feasible deadline")
    page.screenshot(path=str(ui_stack.shots / "ui-rejected.png"))


def test_an_admitted_run_shows_its_allocation_history_artifact(runs: Runs, ui_stack: UiStack, page: Any) -> None:
    page.goto(f"{ui_stack.ui_url}/runs/flow-run/{runs.admitted}")
    wait_text(page, "Completed")
    open_tab(page, "Artifacts")
    wait_text(page, "ElasticFlow allocation history")
    page.screenshot(path=str(ui_stack.shots / "ui-admitted-artifacts-tab.png"))
    page.get_by_text("ElasticFlow allocation history").first.click()  # the card opens the artifact
    wait_text(page, "minimum satisfactory share")
    for action in ("admitted", "launch", "release"):
        expect_cell(page, action)
    page.screenshot(path=str(ui_stack.shots / "ui-admitted-artifact.png"))


def test_a_runs_own_page_says_where_it_runs_and_how_it_stands_without_a_click(
        runs: Runs, ui_stack: UiStack, page: Any) -> None:
    """The run page opens on its logs: the service's lines there are the
    story (decision, GPUs and nodes, projected finish against the deadline,
    the outlook, a resize, the outcome) for an admitted, a resized and a
    rejected run, read at 1280 pixels without clicking anything."""
    page.set_viewport_size({"width": 1280, "height": 900})
    page.goto(f"{ui_stack.ui_url}/runs/flow-run/{runs.admitted}")
    wait_text(page, "ElasticFlow: admitted with a minimum satisfactory share")
    wait_text(page, "ElasticFlow: launched on 2 GPUs 0,1 (localhost); projected finish")
    wait_text(page, ": on track (")
    wait_text(page, "deadline met (")
    page.screenshot(path=str(ui_stack.shots / "ui-run-page-admitted.png"))
    page.goto(f"{ui_stack.ui_url}/runs/flow-run/{runs.resized}")
    wait_text(page, "ElasticFlow: resized: now on 1 GPU")
    page.get_by_text("ElasticFlow: resized: now on 1 GPU").first.scroll_into_view_if_needed()
    page.screenshot(path=str(ui_stack.shots / "ui-run-page-resized.png"))
    page.goto(f"{ui_stack.ui_url}/runs/flow-run/{runs.rejected}")
    wait_text(page, "Rejected")
    wait_text(page, "ElasticFlow rejected this run: This run needs about")
    wait_text(page, "infeasible_even_on_an_idle_cluster")
    wait_text(page, "usable GPU counts at global batch")
    page.screenshot(path=str(ui_stack.shots / "ui-run-page-rejected.png"))


def test_the_cluster_view_fits_a_1280_pixel_window(runs: Runs, ui_stack: UiStack, page: Any) -> None:
    page.set_viewport_size({"width": 1280, "height": 900})
    page.goto(f"{ui_stack.ui_url}/artifacts/artifact/{runs.cluster_artifact}")
    wait_text(page, "GPUs busy")
    table = page.locator("table").last
    table.wait_for(state="visible", timeout=15_000)
    overflow = page.evaluate("() => [...document.querySelectorAll('*')].filter(e => "
                             "e.scrollWidth > e.clientWidth + 1 && getComputedStyle(e).overflowX !== 'visible')"
                             ".map(e => e.tagName + ':' + e.scrollWidth + '>' + e.clientWidth + ' ' + e.className + ' ' + "
                             "(e.firstElementChild ? e.firstElementChild.tagName : '') + ' ' + "
                             "e.innerText.slice(0, 60).replaceAll('\\n', ' / '))")
    page.screenshot(path=str(ui_stack.shots / "ui-cluster-1280.png"), full_page=True)
    assert page.evaluate("() => document.documentElement.scrollWidth") <= 1280
    assert not [o for o in overflow if not o.startswith(("HTML", "BODY"))], overflow


def expect_cell(page: Any, text: str) -> None:
    cell = page.locator("td", has_text=text)
    try:
        cell.first.wait_for(state="visible", timeout=15_000)
    except Exception as exc:
        raise AssertionError(f"no table cell {text!r} on {page.url}:\n{page.inner_text('body')[:3000]}") from exc


def test_the_cluster_artifact_renders_its_tables_and_the_embedded_plot(
    runs: Runs, ui_stack: UiStack, page: Any
) -> None:
    """A markdown artifact's `![](data:image/png;base64,...)` image is shown by
    the UI (so the plot needs no file server), and an in-place update is what
    the page shows."""
    page.goto(f"{ui_stack.ui_url}/artifacts/artifact/{runs.cluster_artifact}")
    wait_text(page, "0/2 GPUs busy")  # the updated version: the run finished
    expect_cell(page, "met")
    expect_cell(page, short_name(runs.admitted_name))  # as the jobs table cuts a long one
    image = page.locator('img[src^="data:image/png;base64,"]')
    image.first.wait_for(state="visible", timeout=15_000)
    image.first.scroll_into_view_if_needed()
    width = image.first.evaluate("img => img.complete ? img.naturalWidth : 0")
    assert width == 900, f"the embedded plot did not load (naturalWidth {width})"
    page.screenshot(path=str(ui_stack.shots / "ui-cluster-artifact.png"), full_page=True)

    page.goto(f"{ui_stack.ui_url}/artifacts/key/{CLUSTER_KEY}")
    wait_text(page, runs.cluster_artifact[:8])  # versions are listed by their short ids
    wait_text(page, "0/2 GPUs busy")  # the key page shows the description: the view in one line, then a link
    link = page.get_by_role("link", name="open the GPU map, the jobs and the plot").first
    assert link.get_attribute("href") == f"/artifacts/artifact/{runs.cluster_artifact}"
    versions = page.get_by_text(re.compile(r"^[0-9a-f]{8}$"))
    assert versions.count() == 1, "an in-place update must not add a version"
