"""A user model factory, referenced by import path in the tests."""

from torch import nn


def tiny_classifier(features: int = 32, classes: int = 10) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(features, classes))


def broken(**kwargs: object) -> nn.Module:
    """A factory that fails every time: what a run with a bad setting does in its ranks."""
    raise ValueError("this model cannot be built with these settings")


class _FailsLater(nn.Module):
    """Trains for a few forward passes, then fails, in every process it is built in."""

    def __init__(self, after: int) -> None:
        super().__init__()
        self.body, self.after, self.calls = nn.Sequential(nn.Flatten(), nn.Linear(32, 10)), after, 0

    def forward(self, x):  # type: ignore[no-untyped-def]
        self.calls += 1
        if self.calls > self.after:
            raise RuntimeError("failed after training had begun")
        return self.body(x)


def fails_later(after: int = 10) -> nn.Module:
    return _FailsLater(after)


def snooper(attempts: dict[str, list[str]], features: int = 32, classes: int = 10) -> nn.Module:
    """What a hostile user's factory would try from inside a rank: each
    attempt is `[kind, path]` (`read`, `write`, `list`, `append`); what came of
    it (`ok` or the error's name) and who the rank is go to `attempts.json`
    in its working directory. Then an honest model, so the run trains."""
    import json
    import os

    seen: dict[str, object] = {"uid": os.getuid(), "groups": os.getgroups(), "cwd": os.getcwd()}
    for name, (kind, path) in attempts.items():
        try:
            if kind == "read":
                with open(path, "rb") as fh:
                    fh.read(1)
            elif kind == "list":
                os.listdir(path)
            elif kind == "write":
                with open(os.path.join(path, f"planted-by-{os.getpid()}"), "w") as fh:
                    fh.write("x")
            elif kind == "append":
                with open(path, "ab") as fh:
                    fh.write(b"x")
            seen[name] = "ok"
        except OSError as exc:
            seen[name] = type(exc).__name__
    with open("attempts.json", "w") as fh:
        json.dump(seen, fh)
    return tiny_classifier(features, classes)
