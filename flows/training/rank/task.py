"""A training task: what a user brings, and what the platform keeps.

The user brings a model (a registered name or a factory by import path), a
dataset (a registered one, or an indexable `torch.utils.data.Dataset` or a
factory of one by import path), a loss of the model's output and the batch,
and optionally a collate function and an evaluation. The platform keeps
which samples form each global batch (sampler.py), each rank's shard, the
gradient scaling and the checkpoints: a user's task is asked only for the
samples it is given and the loss of one micro-batch, so a resize still
changes nothing.

How a batch meets the model: a mapping (Hugging Face style) is passed as
keyword arguments, `model(**batch)`; a tuple or list `(inputs, targets, ...)`
as `model(inputs)`; anything else as `model(batch)`. The loss:

- `cross_entropy` (the default): of the output's logits (the output itself,
  or its `.logits` / `["logits"]`) and the targets (`batch[1]`, or
  `batch["labels"]`), per sample;
- `model`: the output's own `.loss` / `["loss"]` (a model given `labels`
  computes it, as Hugging Face models do);
- `pkg.module:function` of `(output, batch)`.

A loss is one value per sample (shape `[n]`) or their mean (a scalar, as
`model` losses are). The platform back-propagates the micro-batch's sum
scaled by `W / B`, so every rank applies the gradient of the mean over the
same global batch whatever the world size `W`. A scalar is taken as the
mean of per-sample terms: one averaged over tokens is exact when every
sample has as many counted tokens (otherwise return one value per sample).

Imported only in the run's own processes (its ranks), and at take-in in a
short-lived process (task_check.py), never in the scheduler's.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import IterableDataset, default_collate

from flows.training.datasets import DatasetSpec, TensorData, load_dataset
from flows.training.models import build_model, check_allowed, per_sample_loss

log = logging.getLogger("elasticflow.worker")
CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")  # the workspace settings cuBLAS is deterministic with


def resolve(path: str, what: str) -> Any:
    """The object `pkg.module:name` names, under a module the operator allows.
    Raises ValueError naming `what` (the parameter)."""
    check_allowed(path, what)
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except (Exception, SystemExit) as exc:  # ImportError, or the module's own error at import
        raise ValueError(f"{what}: cannot import module {module_name!r}: {type(exc).__name__}: {exc}") from None
    if not hasattr(module, attr):
        raise ValueError(f"{what}: module {module_name!r} has no {attr!r}")
    return getattr(module, attr)


def resolve_callable(path: str, what: str) -> Callable[..., Any]:
    found = resolve(path, what)
    if not callable(found):
        raise ValueError(f"{what}: {path!r} is a {type(found).__name__}, not a function")
    return found


def build_dataset(spec: DatasetSpec) -> Any:
    """The dataset `spec` names: a registered one (loaded whole, `TensorData`),
    or a user's, which must be indexable (`__len__`, `__getitem__`)."""
    if not spec.user:
        return load_dataset(spec)
    found = resolve(spec.name, "dataset")
    if callable(found) and not _indexable(found):
        kwargs = dict(spec.options) | ({"path": spec.path} if spec.path else {})
        dataset = found(**kwargs)
    elif spec.options or spec.path:
        raise ValueError(f"dataset: {spec.name!r} is a dataset, not a factory: it takes no options or path")
    else:
        dataset = found
    if isinstance(dataset, IterableDataset) or not _indexable(dataset):
        raise ValueError(f"dataset: {spec.name!r} gave a {type(dataset).__name__}, not an indexable dataset "
                         "(__len__ and __getitem__): the platform chooses each global batch by index")
    if len(dataset) < 1:
        raise ValueError(f"dataset: {spec.name!r} is empty")
    return dataset


def _indexable(obj: Any) -> bool:
    return not isinstance(obj, type) and hasattr(obj, "__len__") and hasattr(obj, "__getitem__")


def to_device(batch: Any, device: torch.device) -> Any:
    """Every tensor of `batch` (nested in mappings, tuples, lists) on `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def forward(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(batch[0])
    return model(batch)


def _field(output: Any, name: str) -> Any:
    if isinstance(output, Mapping):
        return output.get(name)
    return getattr(output, name, None)


def cross_entropy(output: Any, batch: Any) -> torch.Tensor:
    logits = output if isinstance(output, torch.Tensor) else _field(output, "logits")
    targets = batch.get("labels") if isinstance(batch, Mapping) else batch[1]
    if logits is None or targets is None:
        raise ValueError("loss: cross_entropy needs logits (the output, or its .logits) and targets (batch[1], or "
                         "batch['labels']); give loss='model' or your own")
    return per_sample_loss(logits, targets)


def model_loss(output: Any, batch: Any) -> torch.Tensor:
    loss = _field(output, "loss")
    if not isinstance(loss, torch.Tensor):
        raise ValueError(f"loss: 'model' needs the model's output to carry its loss (.loss or ['loss']); it gave a "
                         f"{type(output).__name__} without one (was it given the labels?)")
    return loss


class Task:
    """A rank's task: it builds the model and the data, makes the batch of
    the samples a rank is given, and says the summed loss of a micro-batch."""

    def __init__(self, model: str, model_kwargs: dict[str, Any], dataset: DatasetSpec, loss: str = "cross_entropy",
                 collate: str | None = None, evaluate: str | None = None) -> None:
        self.model_name, self.model_kwargs, self.dataset_spec = model, model_kwargs, dataset
        self.loss_fn: Callable[[Any, Any], torch.Tensor] = (
            cross_entropy if loss == "cross_entropy" else model_loss if loss == "model"
            else resolve_callable(loss, "loss"))
        self.collate = resolve_callable(collate, "collate") if collate else None
        self.evaluation = resolve_callable(evaluate, "evaluate") if evaluate else None
        self.data: Any = None

    @classmethod
    def of(cls, spec: Any) -> Task:
        """The task of a `SegmentSpec` (or `TrainParameters`)."""
        return cls(spec.model, spec.model_kwargs, spec.dataset, spec.loss, spec.collate, spec.evaluate)

    def build_model(self) -> nn.Module:
        return build_model(self.model_name, self.model_kwargs)

    def load(self) -> None:
        self.data = build_dataset(self.dataset_spec)

    def __len__(self) -> int:
        return len(self.data)

    def batch(self, indices: torch.Tensor) -> Any:
        """The batch of samples `indices` (registered data without a collate: at once)."""
        if self.collate is None and isinstance(self.data, TensorData):
            return self.data.batch(indices)
        samples = [self.data[int(i)] for i in indices]
        return (self.collate or default_collate)(samples)

    def summed_loss(self, model: nn.Module, batch: Any, n: int) -> torch.Tensor:
        """The sum of the micro-batch's `n` per-sample losses (a mean is taken as one of `n` terms)."""
        loss = self.loss_fn(forward(model, batch), batch)
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"loss: gave a {type(loss).__name__}, not a tensor")
        if loss.dim() == 0:
            return loss * n
        if tuple(loss.shape) == (n,):
            return loss.sum()
        raise ValueError(f"loss: gave shape {tuple(loss.shape)} for a micro-batch of {n} samples: give one value "
                         f"per sample ([{n}]) or their mean (a scalar)")

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """The user's evaluation of the trained model ({} without one), in
        eval mode and without gradients. One that fails is logged and costs
        the run nothing: it comes after the run's last checkpoint."""
        if self.evaluation is None:
            return {}
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                metrics = self.evaluation(model)
            if not isinstance(metrics, Mapping):
                raise TypeError(f"gave a {type(metrics).__name__}, not a mapping of metric names to numbers")
            metrics = {str(k): float(v) for k, v in metrics.items()}
        except Exception:
            log.exception("evaluate: the task's evaluation failed; the trained model is in the last checkpoint")
            return {}
        finally:
            model.train(was_training)
        log.info("evaluation: %s", metrics)
        return metrics


def make_deterministic() -> None:
    """Deterministic kernels only, before anything touches CUDA: an op with no
    deterministic implementation then raises, naming itself, rather than
    make a resized run differ from a never-resized one. cuBLAS reads its
    workspace setting when a rank first uses it; an operator's own
    deterministic one is kept."""
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in CUBLAS_DETERMINISTIC:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_DETERMINISTIC[0]
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False

