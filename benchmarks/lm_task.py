"""A character-level language model on text every Python install carries: its standard library.

Corpus: the ``.py`` files of the running interpreter's standard library (PSF licence; no
download, nothing vendored), tests, IDLE and lib2to3 left out, sorted by path. Every 20th file
is validation, the rest training, so the two never share a file. Bytes above 127 become ``?``
(a 128-symbol vocabulary). About 10 MB of training text on CPython 3.11: far more than a
benchmark of minutes reads, so nobody overfits.

Model: a decoder-only transformer (pre-norm blocks of ``torch.nn.TransformerEncoderLayer`` with a
causal mask, learned positions, tied input/output embeddings), 2.2M parameters by default.
The loss is reported in bits per byte (cross entropy / ln 2), the unit character models use.
"""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import torch

VOCAB = 128
SKIPPED_DIRS = {"test", "tests", "site-packages", "idlelib", "lib2to3", "__pycache__"}


def stdlib_corpus() -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation): uint8 tensors of ASCII bytes from the standard library's source."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        f for f in root.rglob("*.py") if not SKIPPED_DIRS & set(f.relative_to(root).parts)
    )
    if len(files) < 40:
        raise RuntimeError(f"only {len(files)} source files under {root}: no corpus here")
    train, val = bytearray(), bytearray()
    for i, f in enumerate(files):
        (val if i % 20 == 0 else train).extend(f.read_bytes())
    t = torch.frombuffer(train, dtype=torch.uint8).clone()
    v = torch.frombuffer(val, dtype=torch.uint8).clone()
    t[t > 127] = ord("?")
    v[v > 127] = ord("?")
    return t, v


class CharTransformer(torch.nn.Module):
    def __init__(self, context: int = 64, width: int = 192, layers: int = 5, heads: int = 6):
        super().__init__()
        self.context = context
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.position = torch.nn.Parameter(torch.zeros(context, width))
        layer = torch.nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(width)
        self.register_buffer(
            "mask", torch.nn.Transformer.generate_square_subsequent_mask(context), persistent=False
        )
        torch.nn.init.normal_(self.embed.weight, std=0.02)
        torch.nn.init.normal_(self.position, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        h = self.embed(tokens) + self.position[:n]
        h = self.blocks(h, mask=self.mask[:n, :n], is_causal=True)
        return self.norm(h) @ self.embed.weight.t()  # tied output embedding


def make_model(seed: int = 0, **kwargs) -> CharTransformer:
    """The same initial weights in every process (``seed``)."""
    torch.manual_seed(seed)
    return CharTransformer(**kwargs)


def batches(text: torch.Tensor, batch: int, context: int, seed: int):
    """Endless random windows (input, next-byte target) from ``text``, reproducible per seed."""
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(context + 1)
    while True:
        starts = torch.randint(0, len(text) - context - 1, (batch,), generator=gen)
        window = text[starts.unsqueeze(1) + offsets].long()
        yield window[:, :-1], window[:, 1:]


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def validation_windows(val: torch.Tensor, count: int, context: int) -> tuple[torch.Tensor, ...]:
    """A fixed set of ``count`` windows (the same in every run and process)."""
    return next(batches(val, count, context, seed=12345))


@torch.no_grad()
def bits_per_byte(model: torch.nn.Module, windows: tuple[torch.Tensor, torch.Tensor]) -> float:
    x, y = windows
    total = 0.0
    for i in range(0, len(x), 64):
        total += float(loss_of(model, x[i : i + 64], y[i : i + 64])) * len(x[i : i + 64])
    return total / len(x) / math.log(2)
