"""Teams: one team floods the cluster; do the others keep their deadlines?

A reference trace (dev102, 500 jobs on 8x8 A100) is dealt to three teams in
turn (a, b, c; shares 24, 20 and 20 GPUs). Team a then floods: N more jobs
(copies of the trace's own, drawn with a seed) submitted within the first
hour. Through the service's own control loop, with the default policy:
  teams, calm      the teams policy without the flood (each team's ratio "as usual")
  teams, flood     the teams policy with it
  one queue, calm  / flood: the same jobs with no teams file (today's service)
Printed: each team's deadline ratio, the overall ratio, GPU use, admitted misses,
and the LP bound of each team's jobs on its share alone (the scenario is
scheduler_service/simulator/teams_case.py; `elasticflow reproduce` shows it too).

Run: .venv/bin/python bench/teams.py              (about 20 s on 2 cores)
     .venv/bin/python bench/teams.py --flood 600
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler_service.simulator.reproduce import run_comparison  # noqa: E402
from scheduler_service.simulator.teams_case import Line, TeamsScenario, markdown, moved_by_flood  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--flood", type=int, default=300, help="team a's extra jobs, all within the first hour")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    report = run_comparison([], workers=2, teams_scenario=TeamsScenario(flood=args.flood, seed=args.seed))
    teams = report.teams_scenario
    assert teams is not None
    print(markdown(teams))
    flood = {t: teams.results[Line(with_teams=t, flooded=True).name] for t in (True, False)}
    print(json.dumps({"others_moved_teams": round(moved_by_flood(teams, True), 4), "others_moved_one_queue":
                      round(moved_by_flood(teams, False), 4), "use_teams_minus_one_queue":
                      round(flood[True].gpu_utilization - flood[False].gpu_utilization, 4),
                      "admitted_missed": sum(r.admitted_missed for r in teams.results.values()),
                      "wall_s": round(report.wall_s, 1)}))


if __name__ == "__main__":
    main()
