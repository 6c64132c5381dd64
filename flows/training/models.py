"""Model registry: built-in networks by name, user networks by import path.

Every model maps a batch of inputs to logits; the loss is cross-entropy over the
last dimension, which covers image classification (logits `[B, C]`, targets
`[B]`) and language modelling (logits `[B, T, V]`, targets `[B, T]`).

Normalisation uses GroupNorm, not BatchNorm: BatchNorm statistics depend on the
local batch, so a model that uses them trains differently on 2 GPUs than on 4
and resizing would change the training semantics. `norm="batch"` is available
for ResNet/VGG when that trade-off is wanted.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch
import torch.nn.functional as F
from torch import nn

from flows.training.allowlist import (  # noqa: F401  # re-exported: where models are named
    MODEL_MODULES_ENV, allowed_model_modules, check_allowed, check_import_path, is_import_path)

DataKind = Literal["images", "vectors", "tokens"]


@dataclass(frozen=True)
class ModelEntry:
    """A registered model: its factory and the kind of data it consumes."""

    factory: Callable[..., nn.Module]
    data_kind: DataKind
    description: str


def _norm(kind: str, channels: int) -> nn.Module:
    if kind == "group":
        return nn.GroupNorm(min(32, channels), channels)
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    raise ValueError(f"norm must be 'group' or 'batch', got {kind!r}")


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, norm: str) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.n1 = _norm(norm, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.n2 = _norm(norm, cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), _norm(norm, cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.n1(self.conv1(x)))
        out = self.n2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """CIFAR-style ResNet-18: 3x3 stem, no max-pool, four stages of two blocks."""

    def __init__(self, num_classes: int = 10, in_channels: int = 3, width: int = 64, norm: str = "group") -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), _norm(norm, width), nn.ReLU())
        layers: list[nn.Module] = []
        cin = width
        for i, mult in enumerate((1, 2, 4, 8)):
            cout = width * mult
            for j in range(2):
                layers.append(_BasicBlock(cin, cout, 2 if (j == 0 and i > 0) else 1, norm))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))


class VGG(nn.Module):
    """CIFAR-style VGG (default VGG-11 configuration) with a single linear head."""

    CONFIGS = {
        "vgg11": [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
        "vgg16": [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
    }

    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 3,
        config: str = "vgg11",
        width_div: int = 1,
        norm: str = "group",
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        cin = in_channels
        for item in self.CONFIGS[config]:
            if item == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                cout = max(8, int(item) // width_div)
                layers += [nn.Conv2d(cin, cout, 3, padding=1, bias=False), _norm(norm, cout), nn.ReLU()]
                cin = cout
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.features(x), 1), 1))


class MLP(nn.Module):
    """A plain multi-layer perceptron over flat feature vectors."""

    def __init__(self, in_features: int = 32, hidden: int = 64, depth: int = 2, num_classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        cin = in_features
        for _ in range(depth):
            layers += [nn.Linear(cin, hidden), nn.ReLU()]
            cin = hidden
        layers.append(nn.Linear(cin, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))


class _CausalBlock(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A small GPT-style decoder-only language model (pre-LN, learned positions).

    Dropout defaults to 0 so that training is a function of the data order only
    and resizing does not change the loss trajectory.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 32,
        dim: int = 64,
        depth: int = 2,
        heads: int = 4,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.tok = nn.Embedding(vocab_size, dim)
        self.pos = nn.Parameter(torch.zeros(1, block_size, dim))
        self.blocks = nn.ModuleList(_CausalBlock(dim, heads, dropout) for _ in range(depth))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        nn.init.normal_(self.pos, std=1 / math.sqrt(dim))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.block_size}")
        mask = torch.triu(torch.full((t, t), float("-inf"), device=idx.device), diagonal=1)
        x = self.tok(idx) + self.pos[:, :t]
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln(x))


MODELS: dict[str, ModelEntry] = {
    "resnet": ModelEntry(ResNet18, "images", "CIFAR-style ResNet-18 (GroupNorm)"),
    "vgg": ModelEntry(VGG, "images", "CIFAR-style VGG-11 (GroupNorm)"),
    "mlp": ModelEntry(MLP, "vectors", "multi-layer perceptron"),
    "transformer": ModelEntry(TinyGPT, "tokens", "small GPT-style language model"),
}


def known_models() -> list[str]:
    return sorted(MODELS)


def resolve_factory(name: str) -> Callable[..., nn.Module]:
    """The factory for a registered name or a `pkg.module:factory` import path
    under a module the operator allowed.

    Raises ValueError naming the known models, so a typo fails at submission.
    """
    if name in MODELS:
        return MODELS[name].factory
    if is_import_path(name):
        check_allowed(name)
        module_name, _, attr = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(f"cannot import model module {module_name!r}: {exc}") from exc
        factory = getattr(module, attr, None)
        if not callable(factory):
            raise ValueError(f"{module_name!r} has no callable {attr!r}")
        return factory
    raise ValueError(f"unknown model {name!r}; known models: {', '.join(known_models())} (or 'pkg.module:factory')")


def data_kind(name: str) -> DataKind | None:
    """The data a registered model consumes; None for user models (they name a dataset)."""
    entry = MODELS.get(name)
    return entry.data_kind if entry else None


def build_model(name: str, kwargs: dict[str, Any] | None = None) -> nn.Module:
    model = resolve_factory(name)(**(kwargs or {}))
    if not isinstance(model, nn.Module):
        raise TypeError(f"model factory {name!r} returned {type(model).__name__}, not torch.nn.Module")
    return model


def per_sample_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy per sample (averaged over tokens for sequence models)."""
    losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    return losses.reshape(targets.shape[0], -1).mean(dim=1)
