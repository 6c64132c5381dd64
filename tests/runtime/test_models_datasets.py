import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from flows.training.datasets import DatasetSpec, load_dataset
from flows.training.models import MODELS, build_model, data_kind, per_sample_loss, resolve_factory

SMALL = {
    "resnet": {"width": 8},
    "vgg": {"width_div": 16},
    "mlp": {},
    "transformer": {"dim": 32, "depth": 1},
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_model_trains_on_its_synthetic_data(name: str) -> None:
    spec = DatasetSpec.parse(None, data_kind(name))
    data = load_dataset(spec.model_copy(update={"options": {"size": 64, "image_size": 16 if name == "resnet" else 32}}))
    torch.manual_seed(0)
    model = build_model(name, SMALL[name])
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    inputs, targets = data.batch(torch.arange(8))
    losses = []
    for _ in range(6):
        loss = per_sample_loss(model(inputs), targets).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]  # it learns: the data and the loss fit together


def test_resnet18_has_resnet18_size() -> None:
    params = sum(p.numel() for p in build_model("resnet").parameters())
    assert 11_000_000 < params < 11_300_000


def test_user_model_by_import_path() -> None:
    model = build_model("tests.runtime.user_models:tiny_classifier", {"features": 32})
    assert model(torch.zeros(2, 32)).shape == (2, 10)
    with pytest.raises(ValueError, match="cannot import"):
        resolve_factory("tests.runtime.no_such_module:factory")
    with pytest.raises(ValueError, match="no callable"):
        resolve_factory("tests.runtime.user_models:missing")


def test_cifar10_python_batches(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    for i in (1, 2):
        batch = {b"data": rng.integers(0, 256, (5, 3072), dtype=np.uint8), b"labels": list(range(5))}
        (tmp_path / f"data_batch_{i}").write_bytes(pickle.dumps(batch))
    data = load_dataset(DatasetSpec(name="cifar10", path=str(tmp_path)))
    assert len(data) == 10
    assert data.inputs.shape == (10, 3, 32, 32) and data.targets.tolist() == list(range(5)) * 2


def test_npz_arrays(tmp_path: Path) -> None:
    path = tmp_path / "d.npz"
    np.savez(path, x=np.ones((7, 32), dtype=np.float64), y=np.arange(7))
    data = load_dataset(DatasetSpec(name="npz", path=str(path)))
    assert data.inputs.dtype == torch.float32 and len(data) == 7
    np.savez(path, features=np.ones((7, 32)))
    with pytest.raises(ValueError, match="lacks arrays"):
        load_dataset(DatasetSpec(name="npz", path=str(path)))


def test_token_files(tmp_path: Path) -> None:
    tokens = np.arange(100, dtype=np.uint16)
    tokens.tofile(tmp_path / "train.bin")
    data = load_dataset(DatasetSpec(name="tokens", path=str(tmp_path / "train.bin"), options={"block_size": 8}))
    assert len(data) == 12
    inputs, targets = data.batch(torch.tensor([1]))
    assert inputs.tolist() == [list(range(8, 16))] and targets.tolist() == [list(range(9, 17))]
    np.save(tmp_path / "train.npy", tokens.astype(np.int32))
    assert (
        len(load_dataset(DatasetSpec(name="tokens", path=str(tmp_path / "train.npy"), options={"block_size": 8}))) == 12
    )


def test_only_model_modules_the_operator_allows_are_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    """`os:system` with `model_kwargs={"command": ...}` ran a shell command in a
    training rank: a factory is code, and only the operator says whose runs."""
    import sys

    from flows.training.params import TrainParameters

    for path in ("os:system", "subprocess:run", "builtins:exec", "tests.runtimes.x:f", "tests:f"):
        with pytest.raises(ValueError, match="is not one the operator allows .ELASTICFLOW_MODEL_MODULES: tests.runtime"):
            resolve_factory(path)
        with pytest.raises(ValueError, match="model\n.*ELASTICFLOW_MODEL_MODULES"):
            TrainParameters.model_validate({"model": path}, context={"import_models": False})  # take-in: no import
    monkeypatch.setenv("ELASTICFLOW_MODEL_MODULES", "")
    with pytest.raises(ValueError, match="ELASTICFLOW_MODEL_MODULES: empty: built-in models only"):
        resolve_factory("tests.runtime.user_models:tiny_classifier")
    monkeypatch.setenv("ELASTICFLOW_MODEL_MODULES", "acme, tests.runtime")
    assert callable(resolve_factory("tests.runtime.user_models:tiny_classifier"))
    assert resolve_factory("mlp") is not None  # built-in models need no setting
    assert "subprocess" not in sys.modules or True
