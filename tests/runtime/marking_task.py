"""A user's task whose module marks every process that runs it (its pid, in
the file ELASTICFLOW_TEST_IMPORT_MARKS names): the take-in check's tests see
where it was imported, and that a typo was found without running it."""

import os

import torch
from torch import nn
from torch.utils.data import TensorDataset

if os.environ.get("ELASTICFLOW_TEST_IMPORT_MARKS"):
    with open(os.environ["ELASTICFLOW_TEST_IMPORT_MARKS"], "a") as marks:
        marks.write(f"{os.getpid()}\n")


def model() -> nn.Module:
    return nn.Linear(4, 2)


def dataset() -> TensorDataset:
    return TensorDataset(torch.randn(20, 4), torch.randint(0, 2, (20,)))


def loss(output: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(output, batch[1], reduction="none")
