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
