"""Entry point of a flow process started by the `elasticflow` worker:
`python -m flows.training.boot` instead of `python -m prefect.engine`.

1. Its own session, as Prefect's default launcher gives a flow process: a run
   keeps training when its worker is stopped with Ctrl-C or crashes (a restarted
   worker adopts it), and a signal to the process group reaches the engine.
2. It starts the run's standby DDP workers (`ELASTICFLOW_WORLD_SIZE`, set by the
   worker when it places the run) before anything else, so that their imports
   (torch, ~4 s of CPU each) overlap the engine's: importing Prefect, reading
   the run, loading the flow. The first segment then takes them as it would
   take the standbys of a relaunch; a wrong count costs a cold start, never
   correctness; unused standbys exit with the flow process.
3. It runs `prefect.engine` as `__main__` in this same process, so the
   infrastructure PID Prefect knows is the engine's and cancellation works as
   for `python -m prefect.engine`.

Only the standard library is imported before the engine starts.
"""

from __future__ import annotations

import os
import runpy

WORLD_SIZE_ENV = "ELASTICFLOW_WORLD_SIZE"


def main() -> None:
    try:
        os.setsid()
    except OSError:  # already a session leader
        pass
    try:
        world = int(os.environ.get(WORLD_SIZE_ENV) or 0)
    except ValueError:
        world = 0
    if world > 0:
        from flows.training.standby import POOL

        POOL.refill(world)
    runpy.run_module("prefect.engine", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
