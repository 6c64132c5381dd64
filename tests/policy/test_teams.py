"""Teams sharing a cluster: admission on each team's share, lending what it does not use."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_service.policy import Job, JobStatus, RejectionReason, SchedulingRequest, ThroughputCurve, Topology
from scheduler_service.policy import make_policy
from scheduler_service.policy.elasticflow import ElasticFlowPolicy
from scheduler_service.policy.teams import Team
from scheduler_service.simulator.engine import simulate
from scheduler_service.simulator.metrics import summarize

CURVE = ThroughputCurve({1: 1.0, 2: 1.9, 4: 3.6, 8: 6.8})
TOPO = Topology(1, 1, 8)
TEAMS = (Team("vision", 4), Team("speech", 4))


def job(job_id, team, iterations, deadline, submit=0.0):
    return Job(job_id, submit, iterations, deadline, CURVE, team=team)


def test_without_teams_the_policy_is_the_one_it_always_was():
    assert type(make_policy("elasticflow", TOPO)) is ElasticFlowPolicy


def test_a_team_that_floods_fills_its_own_share_and_no_one_elses():
    policy = make_policy("elasticflow", TOPO, teams=TEAMS)
    flood = [job(f"v{i}", "vision", 3.6 * 3600, 3600 + 300) for i in range(3)]  # each needs 4 GPUs for the hour
    reply = policy.schedule(SchedulingRequest(0.0, flood))
    assert [d.admitted for d in reply.decisions] == [True, False, False]
    refused = reply.decisions[1]
    assert refused.reason is RejectionReason.INSUFFICIENT_CAPACITY
    assert refused.message == ("team vision: up to 4 of its 4 guaranteed GPUs are promised to 1 admitted run before "
                               "this run's deadline (the last promise ends in 1 h 03 min)")
    assert refused.earliest_feasible_deadline > 3600 + 300
    status = {"v0": JobStatus(flood[0].iterations, reply.allocation["v0"], 0.0)}
    (decision,) = policy.schedule(SchedulingRequest(0.0, [job("s0", "speech", 3.6 * 3600, 3600 + 300)],
                                                    status=status)).decisions
    assert decision.admitted and decision.guaranteed  # the other team's share was kept for it


def test_unused_share_is_lent_as_extra_width_and_reclaimed_when_its_owner_needs_it():
    policy = make_policy("elasticflow", TOPO, teams=TEAMS)
    loose = job("s-loose", "speech", 3.6 * 3600, 6 * 3600)
    reply = policy.schedule(SchedulingRequest(0.0, [loose]))
    assert reply.allocation["s-loose"] == 8  # vision's idle share lent to it
    status = {"s-loose": JobStatus(loose.iterations - 600 * 6.8, 8, 0.0)}
    urgent = job("v-urgent", "vision", 3.6 * 3000, 600 + 3300, submit=600.0)  # needs vision's 4 at once
    reply = policy.schedule(SchedulingRequest(600.0, [urgent], status=status))
    assert reply.decisions[0].admitted and reply.decisions[0].guaranteed
    assert reply.allocation == {"s-loose": 4, "v-urgent": 4}  # given back at the owner's first slot
    assert [(u.name, u.share, u.held, u.borrowed) for u in policy.used()] == [("vision", 4, 4, 0), ("speech", 4, 4, 0)]


def test_a_borrowing_limit_caps_what_a_team_holds_beyond_its_share():
    policy = make_policy("elasticflow", TOPO, teams=(Team("vision", 4), Team("speech", 2, borrowing_limit=1),
                                                      Team("nlp", 2)))
    reply = policy.schedule(SchedulingRequest(0.0, [job("s", "speech", 100, 6 * 3600)]))
    assert reply.allocation["s"] == 2  # 4 would borrow 2, over its limit of 1
    policy = make_policy("elasticflow", TOPO, teams=(Team("vision", 4, lending_limit=2), Team("speech", 4)))
    reply = policy.schedule(SchedulingRequest(0.0, [job("s", "speech", 100, 6 * 3600)]))
    assert reply.allocation["s"] == 4  # 8 would borrow 4 of vision's share; it lends 2 at most


def test_extras_go_to_the_team_least_served_for_its_share():
    policy = make_policy("elasticflow", Topology(1, 1, 16), teams=(Team("big", 8), Team("small", 4)))
    jobs = [job("b", "big", 1e6, None), job("s", "small", 1e6, None)]  # best-effort: all they get is lent
    reply = policy.schedule(SchedulingRequest(0.0, jobs))
    assert reply.allocation == {"b": 8, "s": 8}  # 16 GPUs: each doubling to whoever has the least per share


def test_a_run_of_no_known_team_is_told_the_teams_there_are():
    policy = make_policy("elasticflow", TOPO, teams=TEAMS)
    (decision,) = policy.schedule(SchedulingRequest(0.0, [job("x", "robotics", 10, 600)])).decisions
    assert not decision.admitted and decision.reason is RejectionReason.UNKNOWN_TEAM
    assert "vision, speech" in decision.message


def test_shares_beyond_the_cluster_are_refused():
    with pytest.raises(ValueError, match="add up to 12 GPUs; the cluster has 8"):
        make_policy("elasticflow", TOPO, teams=(Team("a", 8), Team("b", 4)))


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.floats(0.1, 4.0), st.floats(1.1, 4.0),
                          st.integers(0, 20)), min_size=1, max_size=14),
       st.sampled_from([(4, 2, 2), (2, 2, 2), (6, 1, 1)]))
def test_no_admitted_run_misses_whatever_the_teams_and_arrivals(specs, shares):
    teams = tuple(Team(n, s) for n, s in zip("abc", shares))
    jobs = [job(f"j{i}", team, hours * 3600 * 1.9, submit * 600.0 + hours * 3600 * slack, submit=submit * 600.0)
            for i, (team, hours, slack, submit) in enumerate(specs)]
    run = simulate(jobs, make_policy("elasticflow", TOPO, teams=teams))
    assert summarize(run).admitted_missed == 0


def test_a_run_too_big_for_its_teams_share_is_not_called_infeasible_on_the_cluster():
    policy = make_policy("elasticflow", TOPO, teams=TEAMS)
    (decision,) = policy.schedule(SchedulingRequest(0.0, [job("big", "vision", 6.0 * 3600, 3600)])).decisions
    assert not decision.admitted and decision.reason is RejectionReason.INSUFFICIENT_CAPACITY
    assert decision.message.startswith("team vision (4 guaranteed GPUs): even its whole share cannot finish it")
    assert decision.earliest_feasible_deadline > 6.0 * 3600 / 3.6  # what its share of 4 GPUs would take


def test_a_teams_file_with_a_bad_field_is_named_and_a_good_one_is_read(tmp_path):
    from scheduler_service.inputfiles import InputError, load_teams

    path = tmp_path / "teams.yaml"
    path.write_text("teams:\n  - name: vision\n    share: 4\n    lending_limit: 2\n  - name: speech\n    share: 4\n")
    assert load_teams(path) == (Team("vision", 4, None, 2), Team("speech", 4))
    path.write_text("teams:\n  - name: vision\n    share: -1\n")
    with pytest.raises(InputError, match="field 'teams.0.share'"):
        load_teams(path)
    path.write_text("teams:\n  - name: vision\n    share: 4\n    shares: 5\n")
    with pytest.raises(InputError, match="field 'teams.0.shares'"):
        load_teams(path)
    path.write_text("teams: [")
    with pytest.raises(InputError, match="not YAML"):
        load_teams(path)
