"""The task of ``moshpit demo`` and ``moshpit train``: 8x8 handwritten digits with a small MLP.

The data set is the one bundled with scikit-learn (1797 images of 8x8 pixels, 10 classes; no
download), so the demo works on a machine without internet. The split into training and test
images is fixed (seeded), so every peer, the baseline and the parent evaluate on the same test
set. Each peer draws its own mini-batches from the training images with its own seed.

scikit-learn is an optional dependency (``pip install 'moshpit-train[demo]'``):
:func:`load_digits_split` raises :class:`MissingDemoDependency` with that line when it is absent.
It reads scikit-learn's copy of the data without importing scikit-learn where it can: that
import (it loads SciPy) took ~2 s of CPU, a third of a peer's start-up here.
"""

from __future__ import annotations

import base64
import gzip
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "DEMO_INSTALL_HINT",
    "DigitsData",
    "MissingDemoDependency",
    "evaluate",
    "load_digits_split",
    "make_model",
    "make_optimizer",
    "params_from_text",
    "params_to_text",
    "train_baseline",
]

DEMO_INSTALL_HINT = "pip install 'moshpit-train[demo]'  (or: pip install scikit-learn matplotlib)"
TEST_FRACTION = 0.3
SPLIT_SEED = 1234
HIDDEN = 64
DEFAULT_LR = 0.003
DEFAULT_BATCH = 32
DIGITS_SHAPE = (1797, 64)  # images, pixels (values 0-16); 10 classes

logger = logging.getLogger(__name__)


class MissingDemoDependency(ImportError):
    """An optional library the demo needs is not installed (the message says how to get it)."""


@dataclass
class DigitsData:
    """The fixed split: float32 images scaled to [0, 1] and int64 labels."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    def batches(self, batch_size: int, seed: int) -> Any:
        """An endless stream of (x, y) mini-batches drawn without replacement per pass."""
        gen = torch.Generator().manual_seed(seed)
        n = len(self.y_train)
        while True:
            order = torch.randperm(n, generator=gen)
            for start in range(0, n - batch_size + 1, batch_size):
                idx = order[start : start + batch_size]
                yield self.x_train[idx], self.y_train[idx]


def load_digits_split() -> DigitsData:
    """The 8x8 digits with the fixed train/test split (30% test, seeded)."""
    x, y = _read_bundled_digits() or _load_digits_through_sklearn()
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(SPLIT_SEED))
    n_test = int(round(len(y) * TEST_FRACTION))
    test, train = order[:n_test], order[n_test:]
    return DigitsData(x[train], y[train], x[test], y[test])


def _load_digits_through_sklearn() -> tuple[torch.Tensor, torch.Tensor]:
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise MissingDemoDependency(
            f"the demo trains on scikit-learn's bundled digits; install it with: {DEMO_INSTALL_HINT}"
        ) from e
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    return x, torch.tensor(digits.target, dtype=torch.int64)


def bundled_digits_path() -> Path | None:
    """scikit-learn's ``digits.csv.gz``, found without importing scikit-learn; None where
    scikit-learn is absent (or blocked) or keeps the file elsewhere."""
    try:
        spec = importlib.util.find_spec("sklearn")
    except (ImportError, ValueError):  # ValueError: sys.modules["sklearn"] is None
        return None
    if spec is None:
        return None
    for root in spec.submodule_search_locations or ():
        path = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            return path
    return None


def _read_bundled_digits() -> tuple[torch.Tensor, torch.Tensor] | None:
    """(images / 16, labels) from :func:`bundled_digits_path`, exactly as ``load_digits()``
    gives them; None (scikit-learn's own loader then reads it) where the file is missing
    or not the 1797 rows of 64 pixels and a label that it has held for years."""
    path = bundled_digits_path()
    if path is None:
        return None
    try:
        with gzip.open(path, "rt", encoding="ascii") as f:
            rows = [line.split(",") for line in f.read().splitlines() if line.strip()]
        table = torch.tensor([[float(v) for v in row] for row in rows], dtype=torch.float64)
    except (OSError, EOFError, UnicodeDecodeError, ValueError) as e:
        logger.debug("could not read %s (%s); loading the digits through scikit-learn", path, e)
        return None
    pixels, labels = table[:, :-1], table[:, -1]
    if (
        tuple(pixels.shape) != DIGITS_SHAPE
        or not bool(((pixels >= 0) & (pixels <= 16)).all())
        or not bool(((labels >= 0) & (labels <= 9) & (labels == labels.round())).all())
    ):
        logger.debug("%s is not the digits layout we know; loading through scikit-learn", path)
        return None
    return pixels.float() / 16.0, labels.long()


def make_model(seed: int = 0) -> torch.nn.Module:
    """64 -> 64 -> 10 MLP; every peer starts from the same weights (same seed)."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 10)
    )
    torch.random.set_rng_state(gen_state)
    return model


def make_optimizer(model: torch.nn.Module, lr: float = DEFAULT_LR) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=lr)


@torch.no_grad()
def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of ``model`` on ``x, y``."""
    logits = model(x)
    loss = float(torch.nn.functional.cross_entropy(logits, y))
    acc = float((logits.argmax(1) == y).float().mean())
    return acc, loss


def train_baseline(
    data: DigitsData,
    samples: int,
    *,
    batch_size: int = DEFAULT_BATCH,
    lr: float = DEFAULT_LR,
    seed: int = 0,
    points: int = 40,
) -> tuple[float, float, list[tuple[int, float, float]]]:
    """One process, the same model and optimizer, ``samples`` training samples.

    Returns (accuracy, loss, curve) where curve holds ``(samples, accuracy, loss)`` points.
    """
    model = make_model(seed)
    opt = make_optimizer(model, lr)
    steps = max(1, samples // batch_size)
    every = max(1, steps // points)
    curve: list[tuple[int, float, float]] = []
    stream = data.batches(batch_size, seed=10_000 + seed)
    for step in range(1, steps + 1):
        x, y = next(stream)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
        opt.step()
        if step % every == 0 or step == steps:
            acc, test_loss = evaluate(model, data.x_test, data.y_test)
            curve.append((step * batch_size, acc, test_loss))
    acc, test_loss = evaluate(model, data.x_test, data.y_test)
    return acc, test_loss, curve


def params_to_text(model: torch.nn.Module) -> str:
    """The model's parameters as one base64 string (float32, in ``parameters()`` order)."""
    flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    return base64.b64encode(flat.numpy().tobytes()).decode()


def params_from_text(model: torch.nn.Module, text: str) -> torch.Tensor:
    """Decode :func:`params_to_text` output into a flat tensor; checks its length."""
    import numpy as np

    flat = torch.from_numpy(np.frombuffer(base64.b64decode(text), dtype=np.float32).copy())
    expected = sum(p.numel() for p in model.parameters())
    if flat.numel() != expected:
        raise ValueError(f"expected {expected} parameters, got {flat.numel()}")
    return flat


def load_flat_params(model: torch.nn.Module, flat: torch.Tensor) -> None:
    """Write a flat parameter vector into ``model`` (inverse of :func:`params_to_text`)."""
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            n = p.numel()
            p.copy_(flat[offset : offset + n].view_as(p))
            offset += n
