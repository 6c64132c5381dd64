"""A HiGHS solver that keeps quiet: the library prints a copyright banner on
stdout when the first solver of a process is made, which would corrupt JSON
or tables written to stdout. Options are fixed for reproducible answers."""

from __future__ import annotations

import os
import sys
import threading

import highspy

_lock = threading.Lock()
_banner_shown = False


def quiet_highs(time_limit_s: float | None = None) -> highspy.Highs:
    global _banner_shown
    with _lock:
        if not _banner_shown:
            sys.stdout.flush()
            saved = os.dup(1)
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, 1)
                solver = highspy.Highs()
            finally:
                os.dup2(saved, 1)
                os.close(saved)
                os.close(devnull)
            _banner_shown = True
        else:
            solver = highspy.Highs()
    solver.setOptionValue("output_flag", False)
    solver.setOptionValue("threads", 1)
    solver.setOptionValue("random_seed", 0)
    if time_limit_s is not None:
        solver.setOptionValue("time_limit", float(time_limit_s))
    return solver
