"""SIGTERM on the flow process: the ranks stop at the next iteration boundary
with a checkpoint first, then the signal does what it would have done."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from flows.training.supervision import RunningSegment


class Termination:
    """Turns SIGTERM on the flow process into a graceful stop of the workers.

    Workers checkpoint at the next boundary; afterwards the previous handler
    gets the signal as if we were not there. Only installable from the main
    thread.

    Under Prefect's engine nothing is installed: Prefect's own SIGTERM bridge
    must stay in place, because the runner acknowledges a cancellation only
    while it is (otherwise a cancelled run ends Crashed, not Cancelled). Its
    `TerminationSignal` reaches `run_training`'s segment, which stops the
    workers the same way (they checkpoint) before the exception goes on.
    """

    def __init__(self) -> None:
        self.segment: RunningSegment | None = None
        self.received = False
        self.previous: Any = None
        self.installed = False

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread() and not _prefect_bridge_installed():
            self.previous = signal.signal(signal.SIGTERM, self._handle)
            self.installed = True

    def watch(self, segment: RunningSegment | None) -> None:
        """The segment a SIGTERM now stops (None between segments)."""
        self.segment = segment

    def give_up(self) -> None:
        """The run is failing already: put the previous handler back, and
        forward nothing (the failure goes on as it is)."""
        self.received = False
        self.restore_and_forward()

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = True
        if self.segment:
            self.segment.request_stop()

    def restore_and_forward(self) -> None:
        if not self.installed:
            return
        signal.signal(signal.SIGTERM, self.previous)
        self.installed = False
        if self.received:
            if callable(self.previous):
                self.previous(signal.SIGTERM, None)
            elif self.previous == signal.SIG_DFL:
                os.kill(os.getpid(), signal.SIGTERM)


def _prefect_bridge_installed() -> bool:
    """Whether SIGTERM is Prefect's bridge (a flow run under Prefect's engine)."""
    from prefect.utilities.engine import _prefect_sigterm_handler

    return signal.getsignal(signal.SIGTERM) is _prefect_sigterm_handler
