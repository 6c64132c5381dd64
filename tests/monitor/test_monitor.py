"""The cluster view and the allocation plot: pure rendering, no Prefect."""

from __future__ import annotations

import io
import struct
from datetime import datetime, timedelta, timezone

import pytest

from scheduler_service.worker.plot import (
    AllocationSample,
    allocation_markdown,
    allocation_plot,
    plotted_jobs,
    samples_from_changes,
)
from scheduler_service.worker.render import (
    ClusterSnapshot,
    JobView,
    Outlook,
    cluster_markdown,
    gpu_map_markdown,
    jobs_markdown,
    outlook,
)

T0 = datetime(2026, 11, 30, 15, 0, tzinfo=timezone.utc)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def s(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def job(name: str, **fields: object) -> JobView:
    values: dict = dict(name=name, flow_run_id=f"{name}-0000-id", model="mlp", status="running")
    values.update(fields)
    return JobView(**values)


def snapshot(*jobs: JobView, at: float = 0, nodes: tuple[str, ...] = ("node-0", "node-1"), per_node: int = 2
             ) -> ClusterSnapshot:
    return ClusterSnapshot(at=s(at), topology="test", nodes=list(nodes), gpus_per_node=per_node, jobs=list(jobs))


def png_size(png: bytes) -> tuple[int, int]:
    assert png[:8] == PNG_SIGNATURE
    assert png[12:16] == b"IHDR"
    return struct.unpack(">II", png[16:24])


def table_rows(markdown: str, first_header: str) -> list[list[str]]:
    """The body rows of the markdown table whose first header cell is `first_header`."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split(" | ")])
    return rows


# -- deadline risk and outlook -------------------------------------------------

@pytest.mark.parametrize(
    ("fields", "at", "expected"),
    [
        (dict(projected_finish=s(100), deadline=s(600)), 0, Outlook.ON_TRACK),
        (dict(projected_finish=s(580), deadline=s(600), at_risk=True), 0, Outlook.AT_RISK),
        (dict(projected_finish=s(580), deadline=s(600)), 0, Outlook.ON_TRACK),  # the loop's flag decides
        (dict(projected_finish=s(601), deadline=s(600), at_risk=True), 0, Outlook.LATE),
        (dict(projected_finish=s(601).replace(tzinfo=None), deadline=s(600), at_risk=True), 0, Outlook.LATE),
        (dict(projected_finish=s(601), deadline=s(600), status="waiting"), 0, Outlook.LATE),  # its plan is late
        (dict(projected_finish=s(590), deadline=s(600)), 700, Outlook.LATE),  # deadline passed, not finished
        (dict(projected_finish=None, deadline=s(600)), 0, Outlook.UNKNOWN),
        (dict(projected_finish=None, deadline=None, share=None), 0, Outlook.BEST_EFFORT),
        (dict(projected_finish=s(9999), deadline=None), 0, Outlook.BEST_EFFORT),
        (dict(status="finished", projected_finish=s(590), deadline=s(600)), 700, Outlook.MET),
        (dict(status="finished", projected_finish=s(610), deadline=s(600)), 700, Outlook.MISSED),
    ],
    ids=["on-track", "at-risk", "near-but-not-flagged", "late", "late-naive-utc", "waiting-planned-late",
         "deadline-passed", "no-projection", "best-effort",
         "best-effort-projected", "met", "missed"],
)
def test_outlook(fields: dict, at: float, expected: Outlook) -> None:
    assert outlook(job("a", **fields), s(at)) is expected


# -- the cluster markdown --------------------------------------------------------

def test_jobs_are_listed_earliest_deadline_first_with_best_effort_last_and_their_markers() -> None:
    view = snapshot(
        job("best", share=None, gpus=[], status="waiting"),
        job("relaxed", share=1, gpus=[0, 1], deadline=s(3600), projected_finish=s(600),
            iterations_done=250, iterations_total=1000),
        job("tight", share=2, gpus=[2, 3], deadline=s(300), projected_finish=s(290), at_risk=True,
            iterations_done=1, iterations_total=3),
        job("doomed", share=1, gpus=[], status="waiting", deadline=s(200), projected_finish=s(260)),
    )
    text = cluster_markdown(view, margin=timedelta(seconds=60))
    rows = table_rows(text, "job")
    assert [row[0].split()[0] for row in rows] == ["doomed", "tight", "relaxed", "best"]
    by_name = {row[0].split()[0]: row for row in rows}
    assert by_name["doomed"][1] == "**late** · waiting"
    assert by_name["tight"][1] == "**at risk**"
    assert by_name["relaxed"][1] == "on track"
    assert by_name["best"][1] == "best-effort · waiting"
    assert by_name["best"][5] == "-" and by_name["best"][4] == "none"
    assert by_name["relaxed"][5] == "1"  # MSS
    assert by_name["relaxed"][6] == "0-1" and by_name["best"][6] == "-"  # GPUs held
    assert by_name["relaxed"][2] == "25%"
    assert by_name["tight"][2] == "33%"
    assert by_name["relaxed"][3] == "15:10:00"
    assert by_name["relaxed"][4] == "16:00:00 (in 1h00m)"
    assert by_name["relaxed"][0] == "relaxed" and len(by_name["relaxed"]) == 7
    assert "4/4 GPUs busy" in text and "4 jobs" in text and "1 late, 1 at risk" in text
    assert rows[0][1] == "**late** · waiting"  # the marker stays near the left


def test_active_jobs_come_before_ended_ones_whatever_their_deadlines() -> None:
    """Issue 46: finished runs came first, and the one active run was row 11 of 13."""
    view = snapshot(
        job("done", status="finished", deadline=s(100), projected_finish=s(90), iterations_done=10,
            iterations_total=10),
        job("cancelled", status="cancelled", deadline=s(150)),
        job("live", share=1, gpus=[0], deadline=s(3600), projected_finish=s(600)),
        job("best", share=None, gpus=[1]),
    )
    rows = table_rows(cluster_markdown(view), "job")
    assert [row[0].split()[0] for row in rows] == ["live", "best", "done", "cancelled"]


def test_the_jobs_table_stays_narrow_for_a_long_name_and_a_run_that_ended_short() -> None:
    """Issue 46: the UI draws cells without wrapping, and at 1280 pixels a
    20-character name and "stopped · cancelled" pushed the GPUs column off the
    edge (the browser test measures it): a long name is cut, an ended run
    says only how it ended."""
    view = snapshot(job("x" * 60, share=1, gpus=[0, 1], deadline=s(3600), projected_finish=s(600)),
                    job("gone", status="cancelled", deadline=s(900)))
    rows = {row[0]: row for row in table_rows(cluster_markdown(view), "job")}
    assert "x" * 19 + "…" in rows and rows["x" * 19 + "…"][6] == "0-1"
    assert rows["gone"][1] == "cancelled"


def test_gpu_map_shows_each_node_and_the_holder_of_each_gpu() -> None:
    view = snapshot(job("fox", gpus=[0, 1]), job("owl", gpus=[3]), nodes=("a", "b"), per_node=2)
    rows = table_rows(gpu_map_markdown(view), "node")
    assert rows == [["a", "`0` fox", "`1` fox"], ["b", "`2` ·", "`3` owl"]]


def test_the_gpu_map_cuts_a_long_name_as_the_jobs_table_does() -> None:
    view = snapshot(job("y" * 60, gpus=[0, 1]), nodes=("a",), per_node=2)
    assert table_rows(gpu_map_markdown(view), "node") == [["a", "`0` " + "y" * 19 + "…", "`1` " + "y" * 19 + "…"]]


def test_gpu_map_of_two_kinds_shows_each_nodes_kind_and_its_own_number_of_gpus() -> None:
    view = ClusterSnapshot(at=s(0), topology="A100 + T4", nodes=["big", "small"], gpus_per_node=4,
                           node_gpus=[4, 2], node_kinds=["A100", "T4"], jobs=[job("fox", gpus=[4, 5])])
    assert view.num_gpus == 6
    rows = table_rows(gpu_map_markdown(view), "node")
    assert rows == [["big (A100)", "`0` ·", "`1` ·", "`2` ·", "`3` ·"], ["small (T4)", "`4` fox", "`5` fox", "", ""]]


def test_the_cluster_view_shows_each_teams_share_what_it_holds_and_what_it_lends() -> None:
    from scheduler_service.worker.render import TeamView, cluster_markdown

    view = snapshot(job("fox", gpus=[0, 1, 2]))
    assert "## Teams" not in cluster_markdown(view)  # one queue: no teams table
    view = view.model_copy(update={"teams": [TeamView(name="vision", share=2, held=3, borrowed=1),
                                             TeamView(name="speech", share=2, held=0, borrowed=0)]})
    rows = table_rows(cluster_markdown(view).split("## Teams", 1)[1], "team")
    assert rows == [["vision", "2", "3", "1", "0"], ["speech", "2", "0", "0", "2"]]


def test_a_gpu_in_hand_over_shows_both_holders_and_gpus_outside_the_topology_are_not_hidden() -> None:
    view = snapshot(job("old", gpus=[0], deadline=s(10)), job("new", gpus=[0, 9], deadline=s(20)),
                    nodes=("solo",), per_node=2)
    text = gpu_map_markdown(view)
    assert table_rows(text, "node") == [["solo", "`0` old + new", "`1` ·"]]
    assert "GPUs outside the topology: `9` new" in text


def test_an_empty_cluster_renders() -> None:
    text = cluster_markdown(snapshot())
    assert "0/4 GPUs busy · 0 jobs" in text
    assert "_No jobs._" in text
    assert table_rows(text, "node") == [["node-0", "`0` ·", "`1` ·"], ["node-1", "`2` ·", "`3` ·"]]


def test_names_with_pipes_do_not_break_the_tables() -> None:
    text = jobs_markdown(snapshot(job("a|b", model="m|x")))
    (row,) = table_rows(text, "job")
    assert len(row) == 7
    assert "a\\|b" in text


def test_times_far_off_carry_their_date_and_past_ones_say_ago() -> None:
    view = snapshot(job("a", deadline=s(3 * 86400), projected_finish=s(-30), status="running"), at=0)
    (row,) = table_rows(jobs_markdown(view), "job")
    assert row[4] == "Dec 03 15:00 (in 3d0h)"  # to the minute: the relative time says the rest
    assert row[3] == "14:59:30"
    (next_year,) = table_rows(jobs_markdown(snapshot(job("b", deadline=s(40 * 86400)), at=0)), "job")
    assert next_year[4].startswith("2027-01-09 15:00 (in ")


def test_progress_is_clamped_and_unknown_totals_show_a_dash() -> None:
    rows = table_rows(jobs_markdown(snapshot(
        job("over", deadline=s(1), iterations_done=12, iterations_total=10),
        job("unknown", deadline=s(2), iterations_done=5, iterations_total=0),
    )), "job")
    assert rows[0][2] == "100%"
    assert rows[1][2] == "-"


# -- the allocation plot ---------------------------------------------------------

SAMPLES = [
    AllocationSample(at=s(0), gpus={"fox": 2}),
    AllocationSample(at=s(30), gpus={"fox": 1, "owl": 1}),
    AllocationSample(at=s(80), gpus={"fox": 2}),
    AllocationSample(at=s(120), gpus={}),
]


def test_the_plot_is_a_png_of_the_asked_size_and_not_blank() -> None:
    png = allocation_plot(SAMPLES, {"fox": s(180), "owl": s(85)}, total_gpus=2, until=s(150))
    assert png_size(png) == (900, 360)
    assert 5_000 < len(png) < 200_000  # small enough to embed in an artifact
    from matplotlib.image import imread

    pixels = imread(io.BytesIO(png))
    assert pixels.std() > 0.05  # something is drawn


def test_the_plot_colours_each_job_and_marks_deadlines() -> None:
    """Samples out of order are sorted; the two jobs' bands and the deadline lines are drawn."""
    from matplotlib.image import imread

    with_deadlines = allocation_plot(list(reversed(SAMPLES)), {"fox": s(100), "owl": s(60)}, total_gpus=2)
    without = allocation_plot(SAMPLES, None, total_gpus=2)
    assert with_deadlines != without
    pixels = imread(io.BytesIO(without))[..., :3]
    # tab10 blue and orange bands are both there
    blue = ((abs(pixels[..., 0] - 0.12) < 0.2) & (abs(pixels[..., 2] - 0.71) < 0.2) & (pixels[..., 1] < 0.6)).sum()
    orange = ((pixels[..., 0] > 0.85) & (abs(pixels[..., 1] - 0.5) < 0.2) & (pixels[..., 2] < 0.3)).sum()
    assert blue > 1000 and orange > 1000


def test_the_last_sample_counts_until_the_end_of_the_plot() -> None:
    samples = [AllocationSample(at=s(0), gpus={"early": 4}), AllocationSample(at=s(10), gpus={"late": 1})]
    assert plotted_jobs(samples, until=s(20), max_jobs=1) == (["early"], ["late"])  # 40 vs 10 GPU-seconds
    assert plotted_jobs(samples, until=s(100), max_jobs=1) == (["late"], ["early"])  # 40 vs 90


def test_an_empty_history_still_gives_a_png() -> None:
    assert png_size(allocation_plot([])) == (900, 360)


def test_many_jobs_share_one_other_band_so_the_legend_stays_readable() -> None:
    samples = [AllocationSample(at=s(i * 10), gpus={f"job-{j:02d}": 1 + (j == 0) for j in range(15)})
               for i in range(5)]
    shown, others = plotted_jobs(samples, max_jobs=4)
    assert shown == ["job-00", "job-01", "job-02", "job-03"]  # most GPU-seconds first, then by name
    assert len(others) == 11
    png = allocation_plot(samples, total_gpus=32, max_jobs=4)
    assert png_size(png)[0] == 900
    import matplotlib.pyplot as plt

    assert not plt.get_fignums()  # no pyplot figures left behind in a long-lived worker


def test_allocation_markdown_embeds_the_png_as_a_data_uri() -> None:
    import base64

    text = allocation_markdown(SAMPLES, total_gpus=2)
    prefix = "![GPUs per job over time](data:image/png;base64,"
    assert prefix in text and text.endswith(")")
    payload = text.split(prefix, 1)[1][:-1]
    assert base64.b64decode(payload)[:8] == PNG_SIGNATURE


def test_samples_from_changes_accumulate_per_run_changes() -> None:
    changes = [
        (s(30), "owl", 1), (s(30), "fox", 1),  # same moment: one sample
        (s(0), "fox", 2),  # out of order
        (s(80), "owl", 0),
        (s(80), "fox", 2),
        (s(120), "fox", 0),
    ]
    samples = samples_from_changes(changes)
    assert [(sample.at, sample.gpus) for sample in samples] == [
        (s(0), {"fox": 2}), (s(30), {"owl": 1, "fox": 1}), (s(80), {"fox": 2}), (s(120), {}),
    ]
    assert samples_from_changes([]) == []
