"""Regression on generated data: `y = x W + b + noise`, learnt by a small MLP
under a mean-squared-error loss. A user's task in full:

    prefect deployment run train/regression --param iterations=200 --param deadline=+10m

or, naming each part (the model factory, the dataset class with its
options, the loss, the evaluation):

    --param model=flows.examples.regression:model
    --param dataset='{"name": "flows.examples.regression:NoisyLinear", "options": {"size": 4096}}'
    --param loss=flows.examples.regression:mse
    --param evaluate=flows.examples.regression:evaluate
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset


class NoisyLinear(Dataset):
    """`size` samples `(x, y)`: `x` standard normal, `y = x W + b + noise`.
    The map (`W`, `b`) comes from `map_seed` and the samples from `seed`, so
    a held-out set is the same map on other samples."""

    def __init__(self, size: int = 2048, features: int = 8, outputs: int = 1, noise: float = 0.1, seed: int = 0,
                 map_seed: int = 1234) -> None:
        g = torch.Generator().manual_seed(map_seed)
        weights, bias = torch.randn(features, outputs, generator=g), torch.randn(outputs, generator=g)
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, features, generator=g)
        self.y = self.x @ weights + bias + noise * torch.randn(size, outputs, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


def model(features: int = 8, hidden: int = 32, outputs: int = 1) -> nn.Module:
    return nn.Sequential(nn.Linear(features, hidden), nn.Tanh(), nn.Linear(hidden, outputs))


def mse(output: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """One squared error per sample (averaged over the outputs): the platform
    sums them over the global batch and divides by its size."""
    return ((output - batch[1]) ** 2).mean(dim=1)


def evaluate(trained: nn.Module) -> dict[str, float]:
    """Mean squared error on 512 held-out samples of the same map."""
    held_out = NoisyLinear(size=512, seed=99)
    device = next(trained.parameters()).device
    return {"held_out_mse": float(mse(trained(held_out.x.to(device)), (held_out.x, held_out.y.to(device))).mean())}
