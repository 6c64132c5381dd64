"""A model that computes its own loss, in the style of Hugging Face: built
from a config (nothing downloaded), called with the batch's `input_ids` and
`labels`, it returns an output whose `.loss` is the mean next-token
cross-entropy. The task says `loss="model"`: use the model's own loss.

    prefect deployment run train/causal-lm --param iterations=200 --param deadline=+10m

A Hugging Face `AutoModelForCausalLM.from_config(...)` behind a factory of
yours trains the same way (its batches are the same mappings); this one
needs no `transformers`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset


@dataclass(frozen=True)
class TinyLMConfig:
    vocab_size: int = 64
    block_size: int = 16
    dim: int = 32
    heads: int = 2
    depth: int = 1


@dataclass
class CausalLMOutput:
    """What a Hugging Face causal LM returns: the loss when given labels, and the logits."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None


class TinyCausalLM(nn.Module):
    """Pre-LN decoder layers over learned positions; no dropout, so training is
    a function of the data order only and a resize changes nothing."""

    def __init__(self, config: TinyLMConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.position = nn.Parameter(torch.randn(1, config.block_size, config.dim) * 0.02)
        layer = nn.TransformerEncoderLayer(config.dim, config.heads, 4 * config.dim, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.layers = nn.TransformerEncoder(layer, config.depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(config.dim)
        self.head = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> CausalLMOutput:
        length = input_ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=input_ids.device)
        hidden = self.layers(self.embed(input_ids) + self.position[:, :length], mask=mask, is_causal=True)
        logits = self.head(self.norm(hidden))
        loss = None
        if labels is not None:  # as Hugging Face does: predict token t+1 from tokens up to t
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return CausalLMOutput(logits=logits, loss=loss)


def build(**config: int) -> TinyCausalLM:
    """The model of a config: `model_kwargs` are `TinyLMConfig`'s fields."""
    return TinyCausalLM(TinyLMConfig(**config))


class Sequences(Dataset):
    """`size` token sequences of `block_size`: steps of 3 through the
    vocabulary from a random start, one token in ten replaced at random.
    Each sample is a mapping, as a Hugging Face tokenizer's batch is."""

    def __init__(self, size: int = 1024, vocab_size: int = 64, block_size: int = 16, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, vocab_size, (size, 1), generator=g)
        tokens = (starts + 3 * torch.arange(block_size)) % vocab_size
        noisy = torch.rand(size, block_size, generator=g) < 0.1
        self.tokens = torch.where(noisy, torch.randint(0, vocab_size, (size, block_size), generator=g), tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}
