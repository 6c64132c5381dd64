"""The one way the service shows text a user wrote (a run's name, its
parameters, a message that quotes them): bounded and escaped, before it
reaches a log line, the store, a Prefect event or state, or a terminal.

Escaped: every control character (a raw newline forged a `finished: met`
line in worker.log; `ESC[2J` cleared the operator's terminal), every bidi
override or isolate (U+202E showed a name backwards) and every invisible
character (U+200B) is written as its escape (`\\n`, `\\x1b`, `\\u202e`).
Bounded: a 10 MB run name crashed its run in Prefect (EventTooLarge) and
grew the worker by gigabytes; names are cut to `NAME_LIMIT` characters,
messages to `MESSAGE_LIMIT`, with an ellipsis saying so.
"""

from __future__ import annotations

import logging
import re

NAME_LIMIT = 200  # a run's name, a model, a team: what a table or a label shows
MESSAGE_LIMIT = 2000  # a state's message, a rejection's reason, one log line's message
ELLIPSIS = "…"

# C0 and C1 controls and DEL; the soft hyphen and Arabic letter mark; every
# zero-width, direction mark, bidi embedding/override/isolate, line and
# paragraph separator and invisible operator (U+200B-U+200F, U+2028-U+202E,
# U+2060-U+206F); the byte-order mark and interlinear annotation controls.
_UNSHOWN = re.compile("[\x00-\x1f\x7f-\x9f\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e"
                      "\u2060-\u206f\ufeff\ufff9-\ufffb]")


def bounded(text: object, limit: int = NAME_LIMIT) -> str:
    """`text` cut to `limit` characters, the cut said by an ellipsis."""
    value = str(text)
    return value if len(value) <= limit else value[:limit - 1] + ELLIPSIS


def printable(text: object) -> str:
    """`text` with every character that could forge a line, move the cursor,
    reorder or hide what follows written as its escape: one line, nothing
    lost to the reader."""
    return _UNSHOWN.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), str(text))


def shown(text: object, limit: int = NAME_LIMIT) -> str:
    """Bounded, then escaped: what the service keeps and shows of user text."""
    return printable(bounded(text, limit))


_NAMES = ("flow_run_name", "task_run_name", "flow_name")  # what Prefect's formats put beside a message


class OneLine(logging.Filter):
    """On a handler (worker.log, the console): every record's message and the
    run names beside it, bounded and escaped, so that no line a run's name
    or message reaches can forge another or drive the terminal. A
    traceback stays as Python formats it."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a record whose arguments do not fit its format: shown as given
            message = f"{record.msg!r} % {record.args!r}"
        record.msg, record.args = shown(message, MESSAGE_LIMIT), None
        for name in _NAMES:
            value = record.__dict__.get(name)
            if isinstance(value, str):
                record.__dict__[name] = shown(value)
        return True


def ranges(numbers: list[int]) -> str:
    """Sorted GPU ids as a person reads them: 0,1,2,5 -> "0-2,5" ("" for none)."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def one_line_logs(logger: logging.Logger) -> None:
    """Put `OneLine` on each handler of `logger` and its ancestors, once."""
    current: logging.Logger | None = logger
    while current is not None:
        for handler in current.handlers:
            if not any(isinstance(f, OneLine) for f in handler.filters):
                handler.addFilter(OneLine())
        current = current.parent if current.propagate else None
