"""Dataset registry: generated synthetic data per model kind, and loaders for a
user's own data on disk (CIFAR-10 python batches, `.npz` arrays, token files).

Nothing here touches the network. Every dataset is loaded whole into memory as
two tensors, and a global batch is chosen by index (see `sampler`), so each
worker can pick its shard of any global batch without a DataLoader whose order
would depend on the number of workers.
"""

from __future__ import annotations

import os

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from flows.training.models import DataKind, check_import_path


@dataclass(frozen=True)
class TensorData:
    """Inputs and targets held in memory; row i is sample i."""

    inputs: torch.Tensor
    targets: torch.Tensor

    def __len__(self) -> int:
        return int(self.inputs.shape[0])

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[indices], self.targets[indices]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample `index`, for a user's collate (without one, `batch` takes a batch at once)."""
        return self.inputs[index], self.targets[index]


class DatasetSpec(BaseModel):
    """Which data to train on. `name` is a registry key, or a user's dataset by
    import path (`pkg.module:name`: a `torch.utils.data.Dataset`, or a factory
    of one called with `options`, and `path=` when a path is given; it is
    imported only in the run's own processes, flows/training/rank/task.py);
    `path` is for on-disk data."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(default="synthetic", description="a registered dataset, or 'pkg.module:name'")
    path: str | None = Field(default=None, description="file or folder for on-disk datasets")
    options: dict[str, Any] = Field(default_factory=dict, description="loader options (size, block_size, ...)")

    @property
    def user(self) -> bool:
        """A user's dataset, by import path."""
        return self.name not in DATASETS

    @model_validator(mode="after")
    def _check(self) -> "DatasetSpec":
        if self.user:
            if ":" not in self.name:
                raise ValueError(f"unknown dataset {self.name!r}; known datasets: {', '.join(sorted(DATASETS))}, "
                                 "or a 'pkg.module:name' import path")
            check_import_path(self.name, "dataset")
            return self
        entry = DATASETS[self.name]
        if entry.needs_path:
            if not self.path:
                raise ValueError(f"dataset {self.name!r} needs a path")
            if not Path(self.path).expanduser().exists():
                raise ValueError(f"dataset path {self.path!r} does not exist")
        return self

    @staticmethod
    def split(text: str) -> dict[str, Any]:
        """`"cifar10:/data/cifar"` (a registered name and its path) or
        `"pkg.module:name"` (a user's dataset, no path)."""
        name, _, path = text.partition(":")
        if name in DATASETS:
            return {"name": name, "path": path or None}
        return {"name": text}

    @classmethod
    def parse(cls, value: "str | dict[str, Any] | DatasetSpec | None", kind: DataKind | None) -> "DatasetSpec":
        """Accept `"cifar10:/data/cifar"` style strings, dicts, or None (synthetic)."""
        if isinstance(value, DatasetSpec):
            spec = value
        elif value is None:
            spec = cls()
        elif isinstance(value, str):
            spec = cls(**cls.split(value))
        else:
            spec = cls(**value)
        if spec.name == "synthetic":
            if kind is None:
                raise ValueError("a model given by import path needs an explicit dataset: a registered one (e.g. "
                                 "'synthetic-images', 'npz:/data/train.npz') or your own, 'pkg.module:name'")
            spec = spec.model_copy(update={"name": f"synthetic-{kind}"})
        return spec


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def synthetic_images(opts: dict[str, Any]) -> TensorData:
    """Class prototypes plus noise: learnable, so a falling loss means training works."""
    n, classes = int(opts.get("size", 1024)), int(opts.get("num_classes", 10))
    channels, side = int(opts.get("channels", 3)), int(opts.get("image_size", 32))
    g = _generator(int(opts.get("seed", 1234)))
    protos = torch.randn(classes, channels, side, side, generator=g)
    targets = torch.randint(0, classes, (n,), generator=g)
    inputs = protos[targets] + float(opts.get("noise", 1.0)) * torch.randn(n, channels, side, side, generator=g)
    return TensorData(inputs, targets)


def synthetic_vectors(opts: dict[str, Any]) -> TensorData:
    """Gaussian features labelled by a fixed random linear map."""
    n, dim, classes = int(opts.get("size", 2048)), int(opts.get("features", 32)), int(opts.get("num_classes", 10))
    g = _generator(int(opts.get("seed", 1234)))
    inputs = torch.randn(n, dim, generator=g)
    targets = (inputs @ torch.randn(dim, classes, generator=g)).argmax(dim=1)
    return TensorData(inputs, targets)


def _windows(tokens: torch.Tensor, block: int) -> TensorData:
    count = (tokens.numel() - 1) // block
    if count < 1:
        raise ValueError(f"token stream of {tokens.numel()} tokens is shorter than block_size + 1 = {block + 1}")
    starts = torch.arange(count) * block
    idx = starts[:, None] + torch.arange(block + 1)[None, :]
    seqs = tokens[idx].long()
    return TensorData(seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous())


def synthetic_tokens(opts: dict[str, Any]) -> TensorData:
    """A noisy affine recurrence over the vocabulary: predictable, so learnable."""
    vocab, block = int(opts.get("vocab_size", 256)), int(opts.get("block_size", 32))
    n = int(opts.get("size", 512))
    g = _generator(int(opts.get("seed", 1234)))
    total = n * block + 1
    stream = torch.empty(total, dtype=torch.long)
    stream[0] = 1
    noise = torch.rand(total, generator=g) < 0.1
    rand = torch.randint(0, vocab, (total,), generator=g)
    for i in range(1, total):  # ~16k steps: fast enough, and obviously deterministic
        stream[i] = rand[i] if noise[i] else (5 * stream[i - 1] + 3) % vocab
    return _windows(stream, block)


def cifar10_batches(path: Path, opts: dict[str, Any]) -> TensorData:
    """The CIFAR-10 "python version": pickled `data_batch_*` dicts of uint8 rows."""
    split = opts.get("split", "train")
    pattern = "data_batch_*" if split == "train" else "test_batch"
    files = sorted(path.glob(pattern))
    if not files:
        raise ValueError(f"no CIFAR-10 {pattern} files under {path}")
    xs, ys = [], []
    for file in files:
        with open(file, "rb") as fh:
            batch = pickle.load(fh, encoding="bytes")
        xs.append(np.asarray(batch[b"data"], dtype=np.uint8))
        ys.extend(batch[b"labels"])
    raw = torch.from_numpy(np.concatenate(xs)).reshape(-1, 3, 32, 32).float() / 255.0
    mean = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1)
    std = torch.tensor([0.2470, 0.2435, 0.2616]).view(1, 3, 1, 1)
    return TensorData((raw - mean) / std, torch.tensor(ys, dtype=torch.long))


def npz_arrays(path: Path, opts: dict[str, Any]) -> TensorData:
    """Any `.npz` with an input array and an integer target array (keys `x`, `y` by default)."""
    with np.load(path) as arrays:
        x_key, y_key = opts.get("inputs_key", "x"), opts.get("targets_key", "y")
        missing = [k for k in (x_key, y_key) if k not in arrays]
        if missing:
            raise ValueError(f"{path} lacks arrays {missing}; it has {list(arrays.keys())}")
        inputs = torch.from_numpy(np.array(arrays[x_key]))
        targets = torch.from_numpy(np.array(arrays[y_key])).long()
    if inputs.dtype in (torch.float64, torch.float16, torch.uint8):
        inputs = inputs.float()
    if len(inputs) != len(targets):
        raise ValueError(f"{path}: {len(inputs)} inputs but {len(targets)} targets")
    return TensorData(inputs, targets)


def token_file(path: Path, opts: dict[str, Any]) -> TensorData:
    """A token stream: `.npy`, or raw little-endian integers (`dtype`, default uint16, as nanoGPT writes)."""
    if path.suffix == ".npy":
        stream = np.load(path)
    else:
        stream = np.fromfile(path, dtype=np.dtype(opts.get("dtype", "uint16")))
    return _windows(torch.from_numpy(stream.astype(np.int64)), int(opts.get("block_size", 32)))


def _unresolved_synthetic(opts: dict[str, Any]) -> TensorData:
    raise ValueError("'synthetic' names the model's synthetic dataset; resolve it with DatasetSpec.parse")


@dataclass(frozen=True)
class DatasetEntry:
    loader: Callable[..., TensorData]
    needs_path: bool
    description: str


DATASETS: dict[str, DatasetEntry] = {
    "synthetic": DatasetEntry(_unresolved_synthetic, False, "the synthetic dataset matching the model"),
    "synthetic-images": DatasetEntry(synthetic_images, False, "generated 3x32x32 images, 10 classes"),
    "synthetic-vectors": DatasetEntry(synthetic_vectors, False, "generated feature vectors, 10 classes"),
    "synthetic-tokens": DatasetEntry(synthetic_tokens, False, "generated token sequences"),
    "cifar10": DatasetEntry(cifar10_batches, True, "CIFAR-10 python batches in a folder"),
    "npz": DatasetEntry(npz_arrays, True, ".npz with x and y arrays"),
    "tokens": DatasetEntry(token_file, True, "token ids in a .npy or raw binary file"),
}


def check_dataset(name: str, path: Path) -> None:
    """Cheap checks that a dataset on disk can be read as `name`, without
    loading it: it exists and is readable, and an `.npz` is an archive of
    arrays (never pickles). Raises OSError or ValueError saying what is wrong."""
    if not path.exists():
        raise ValueError("no such file or folder")
    if not os.access(path, os.R_OK):
        raise ValueError("not readable")
    if path.is_file() and path.stat().st_size == 0:
        raise ValueError("is empty (0 bytes)")
    if name == "npz":
        with np.load(path, allow_pickle=False) as arrays:  # an archive's index only
            if not hasattr(arrays, "files"):
                raise ValueError("not an .npz archive of arrays")
    elif name == "tokens" and path.suffix == ".npy":
        np.load(path, mmap_mode="r", allow_pickle=False)
    elif name == "cifar10" and not path.is_dir():
        raise ValueError("expects the folder of CIFAR-10 python batches")


def load_dataset(spec: DatasetSpec) -> TensorData:
    """A registered dataset (a user's is built by flows/training/rank/task.py, in the run's processes only)."""
    if spec.user:
        raise ValueError(f"dataset {spec.name!r} is a user's: build it with flows.training.rank.task")
    entry = DATASETS[spec.name]
    if entry.needs_path:
        return entry.loader(Path(spec.path or "").expanduser(), spec.options)
    return entry.loader(spec.options)
