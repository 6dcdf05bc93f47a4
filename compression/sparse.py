"""Sparsifiers: TopK (DGC sampled threshold), RandomK (shared seed), ScaledSign (1 bit).

Sent values are float16 of ``value / s`` with a power-of-two scale ``s`` (no overflow, no
flush to zero) or, with ``value_dtype=torch.float32``, raw float32. All three reject NaN/Inf
input with NonFiniteInputError (a NaN would never be selected and stay in an error-feedback
residual forever; an Inf would become the scale of every sign).
"""

from __future__ import annotations

import math
import secrets

import torch

from . import _bytes
from ._sorting import sorted_values
from .base import (
    Codec,
    CompressedTensor,
    MetaValue,
    check_finite_scalar,
    dtype_name,
    expect_len,
    meta_float,
    meta_int,
)
from .errors import MalformedMessageError
from .floating import encode_scaled_fp16, validate_pow2_scale
from .indices import pack_indices, sample_runs, sparse_nonzero, unpack_indices

_MAX_SEED = 2**63 - 1


def _check_finite(flat: torch.Tensor) -> None:
    if flat.numel():
        lo, hi = torch.aminmax(flat)
        check_finite_scalar(lo, "min")
        check_finite_scalar(hi, "max")


def _value_bits(value_dtype: torch.dtype) -> int:
    if value_dtype == torch.float16:
        return 16
    if value_dtype == torch.float32:
        return 32
    raise ValueError("value_dtype must be torch.float16 or torch.float32")


def _encode_values(values: torch.Tensor, vbits: int, buf: torch.Tensor) -> float:
    """Write the selected values at the start of ``buf``; returns their scale (1.0 for fp32)."""
    k = values.numel()
    if vbits == 32:
        _bytes.typed(buf, torch.float32, k).copy_(values)
        return 1.0
    return encode_scaled_fp16(values, _bytes.typed(buf, torch.float16, k))


def _decode_values(ct: CompressedTensor, count: int, vbits: int, device: torch.device):
    scale = meta_float(ct, "scale", positive=True)
    dtype = torch.float16 if vbits == 16 else torch.float32
    # copy=True: for float32 on the CPU ``.to`` would return the payload view itself, and the
    # in-place scaling wrote into the message's bytes (a second decode then scaled twice)
    values = _bytes.view(ct.payload, dtype, count).to(device, torch.float32, copy=True)
    return values.mul_(scale) if scale != 1.0 else values


def _validate_scale(ct: CompressedTensor) -> None:
    validate_pow2_scale(ct)


def density_to_k(n: int, density: float) -> int:
    """Number of entries a density keeps (at least one of a non-empty tensor)."""
    return 0 if n == 0 else min(n, max(1, round(density * n)))


def dgc_select(
    values: torch.Tensor,
    k: int,
    sample_ratio: float = 0.01,
    generator: torch.Generator | None = None,
    exact_below: int = 4096,
) -> torch.Tensor:
    """Sorted indices of about the ``k`` entries of largest magnitude of a flat tensor (DGC).

    Estimates the threshold from a random ``sample_ratio`` sample of |values|, then takes
    everything at or above it in one streaming pass. If that yields more than 1.3k entries,
    keeps the exact top-k among those candidates; if fewer than 0.8k, lowers the threshold
    (a larger sample rank) and retries, falling back to an exact ``torch.topk`` after a few
    tries. The result always has between ``ceil(0.8k)`` and ``floor(1.3k)`` entries.
    """
    n = values.numel()
    device = values.device
    if k >= n:
        return torch.arange(n, device=device)
    if k <= 0:
        return torch.empty(0, dtype=torch.long, device=device)
    if n <= exact_below:
        return _exact_topk(values, k)
    k_lo, k_hi = math.ceil(0.8 * k), max(k, math.floor(1.3 * k))
    sample = sample_runs(values, min(n, max(int(n * sample_ratio), 1024)), generator).abs()
    m = sample.numel()
    rank = max(1, round(m * k / n))
    ranked = torch.topk(sample, min(m, 4 * rank + 8), sorted=True).values
    for _ in range(4):
        threshold = float(ranked[min(rank, ranked.numel()) - 1])
        selected = _at_least(values, threshold)
        count = selected.numel()
        if count > k_hi:  # too many: exact top-k among the candidates only
            best = torch.topk(values[selected].abs(), k, sorted=False).indices
            return sorted_values(selected[best])
        if count >= k_lo:
            return selected
        if rank >= ranked.numel():
            break
        rank = min(ranked.numel(), math.ceil(rank * 1.3 * k / max(count, 1)))
    return _exact_topk(values, k)


def _at_least(values: torch.Tensor, threshold: float) -> torch.Tensor:
    """Sorted indices with |value| >= threshold, streaming through cache-sized slices."""
    n, device = values.numel(), values.device
    size = _bytes.scratch_len(n, device)
    mags = torch.empty(size, dtype=values.dtype, device=device)
    mask = torch.empty(size, dtype=torch.bool, device=device)
    found = []
    for start, stop in _bytes.spans(n, device):
        m = stop - start
        torch.abs(values[start:stop], out=mags[:m])
        torch.ge(mags[:m], threshold, out=mask[:m])
        hits = sparse_nonzero(mask[:m])
        if hits.numel():
            found.append(hits.add_(start))
    if not found:
        return torch.empty(0, dtype=torch.long, device=device)
    return found[0] if len(found) == 1 else torch.cat(found)


def _exact_topk(values: torch.Tensor, k: int) -> torch.Tensor:
    return sorted_values(torch.topk(values.abs(), k, sorted=False).indices)


class TopK(Codec):
    """The ``density`` fraction of entries with the largest magnitude, DGC style.

    Selection uses :func:`dgc_select` (sampled threshold, 0.8k..1.3k entries, no full sort)
    unless ``exact=True`` (``torch.topk``, exactly k). Indices travel as bit-packed gaps
    between sorted indices (e.g. ~10-14 bits at density 0.001 instead of 32 or 64).
    Payload: values (float16 scaled or float32), then the packed gaps.
    """

    codec_id = 7

    def __init__(
        self,
        density: float = 0.01,
        sample_ratio: float = 0.01,
        value_dtype: torch.dtype = torch.float16,
        exact: bool = False,
        seed: int | None = None,
    ):
        if not 0 < density <= 1 or not 0 < sample_ratio <= 1:
            raise ValueError("density and sample_ratio must be in (0, 1]")
        self.density = density
        self.sample_ratio = sample_ratio
        self.value_dtype = value_dtype
        self.exact = exact
        self._vbits = _value_bits(value_dtype)
        self._gen = torch.Generator().manual_seed(secrets.randbits(63) if seed is None else seed)

    def select(self, flat: torch.Tensor, k: int | None = None) -> torch.Tensor:
        """Sorted indices this codec would send for a flat float32 tensor."""
        k = density_to_k(flat.numel(), self.density) if k is None else k
        if self.exact:
            if k >= flat.numel():
                return torch.arange(flat.numel(), device=flat.device)
            return _exact_topk(flat, k)
        return dgc_select(flat, k, self.sample_ratio, self._gen)

    def encode(self, tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, MetaValue]]:
        flat = tensor.reshape(-1)
        _check_finite(flat)
        return self.encode_selected(flat, self.select(flat))

    def encode_selected(self, flat: torch.Tensor, indices: torch.Tensor):
        """Payload and meta sending ``flat[indices]`` (sorted, unique) and nothing else."""
        packed, width = pack_indices(indices)
        k = indices.numel()
        nvalue = k * self._vbits // 8
        buf = _bytes.alloc(nvalue + packed.numel())
        scale = _encode_values(flat[indices].float(), self._vbits, buf)
        buf[nvalue:].copy_(packed)
        return buf, {"k": k, "width": width, "vbits": self._vbits, "scale": scale}

    def compress_selected(self, tensor: torch.Tensor, indices: torch.Tensor) -> CompressedTensor:
        """A TopK message for given indices (used by GraVAC's multi-level selection)."""
        payload, meta = self.encode_selected(tensor.reshape(-1), indices)
        return CompressedTensor(
            self.codec_id,
            dtype_name(tensor.dtype),
            tuple(tensor.shape),
            _bytes.payload(payload),
            meta,
        )

    @classmethod
    def validate(cls, ct: CompressedTensor) -> None:
        k = meta_int(ct, "k", 0, ct.numel)
        width = meta_int(ct, "width", 0, 32)
        vbits = meta_int(ct, "vbits", 16, 32)
        if vbits not in (16, 32):
            raise MalformedMessageError("vbits must be 16 or 32")
        _validate_scale(ct)
        expect_len(ct, k * vbits // 8 + _bytes.packed_bits_nbytes(k * width))

    @classmethod
    def indices(cls, ct: CompressedTensor) -> torch.Tensor:
        """The (validated, sorted, unique) indices a message carries, as CPU int64."""
        k, width, vbits = ct.meta["k"], ct.meta["width"], ct.meta["vbits"]
        return unpack_indices(ct, k, width, k * vbits // 8)

    @classmethod
    def check_content(cls, ct: CompressedTensor) -> None:
        cls.indices(ct)

    @classmethod
    def decode(cls, ct: CompressedTensor, device: torch.device) -> torch.Tensor:
        out = torch.zeros(ct.numel, device=device)
        k, vbits = ct.meta["k"], ct.meta["vbits"]
        if k:
            out[cls.indices(ct).to(device)] = _decode_values(ct, k, vbits, device)
        return out


def random_k_indices(n: int, k: int, seed: int, device: torch.device | str = "cpu"):
    """``k`` sorted distinct indices of ``range(n)``, a pure function of ``(n, k, seed)``.

    Stratified: one uniformly random index in each of ``k`` near-equal strata, so every
    index has probability ~k/n, generation costs O(k) (no permutation of n) and any two
    peers with the same seed get identical indices on any device.
    """
    if not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    gen = torch.Generator().manual_seed(seed)
    bounds = (torch.arange(k + 1, dtype=torch.int64) * n) // max(k, 1)
    sizes = bounds[1:] - bounds[:-1]
    offsets = (torch.rand(k, generator=gen, dtype=torch.float64) * sizes).to(torch.int64)
    return (bounds[:-1] + torch.minimum(offsets, sizes - 1)).to(device)


class RandomK(Codec):
    """A seeded random ``density`` fraction of entries; only the values travel.

    Peers that use the same ``seed`` select identical indices, so the reducer can average
    sparse contributions without any index exchange. Pass ``seed=`` per call (e.g. derived
    from round and part) so different steps select different entries; without one the
    codec's own seed is used, or a fresh random one if it has none.
    """

    codec_id = 8

    def __init__(
        self,
        density: float = 0.01,
        seed: int | None = None,
        value_dtype: torch.dtype = torch.float16,
    ):
        if not 0 < density <= 1:
            raise ValueError("density must be in (0, 1]")
        if seed is not None and not 0 <= seed <= _MAX_SEED:
            raise ValueError("seed must be in [0, 2**63)")
        self.density = density
        self.seed = seed
        self.value_dtype = value_dtype
        self._vbits = _value_bits(value_dtype)

    def encode(
        self, tensor: torch.Tensor, seed: int | None = None
    ) -> tuple[torch.Tensor, dict[str, MetaValue]]:
        seed = seed if seed is not None else self.seed
        if seed is None:
            seed = secrets.randbits(63)
        if not 0 <= seed <= _MAX_SEED:
            raise ValueError("seed must be in [0, 2**63)")
        flat = tensor.reshape(-1)
        _check_finite(flat)
        k = density_to_k(flat.numel(), self.density)
        indices = random_k_indices(flat.numel(), k, seed, flat.device)
        buf = _bytes.alloc(k * self._vbits // 8)
        scale = _encode_values(flat[indices].float(), self._vbits, buf)
        return buf, {"k": k, "seed": seed, "vbits": self._vbits, "scale": scale}

    @classmethod
    def validate(cls, ct: CompressedTensor) -> None:
        k = meta_int(ct, "k", 0, ct.numel)
        meta_int(ct, "seed", 0, _MAX_SEED)
        vbits = meta_int(ct, "vbits", 16, 32)
        if vbits not in (16, 32):
            raise MalformedMessageError("vbits must be 16 or 32")
        _validate_scale(ct)
        expect_len(ct, k * vbits // 8)

    @classmethod
    def decode(cls, ct: CompressedTensor, device: torch.device) -> torch.Tensor:
        k, seed, vbits = ct.meta["k"], ct.meta["seed"], ct.meta["vbits"]
        out = torch.zeros(ct.numel, device=device)
        if k:
            out[random_k_indices(ct.numel, k, seed, device)] = _decode_values(ct, k, vbits, device)
        return out


class ScaledSign(Codec):
    """One bit per value (its sign) and one scale, mean |x|: ``x ~ sign(x) * mean|x|``.

    Zeros are sent as positive. The decoded tensor has exactly the L1 norm of the input
    (1-bit SGD / EF-signSGD / BytePS-Compress's scaled sign).
    """

    codec_id = 9

    def encode(self, tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, MetaValue]]:
        flat = tensor.reshape(-1)
        n = flat.numel()
        packed = _bytes.alloc(_bytes.packed_bits_nbytes(n))
        size = _bytes.scratch_len(n, flat.device)
        negative = torch.empty(size, dtype=torch.bool, device=flat.device)
        mags = torch.empty(size, dtype=flat.dtype, device=flat.device)
        l1 = 0.0  # accumulated in float64 across slices (each slice sums in float32)
        for start, stop in _bytes.spans(n, flat.device):  # slices are multiples of 8 long
            part = flat[start:stop]
            l1 += float(torch.abs(part, out=mags[: stop - start]).sum(dtype=torch.float32))
            bits = torch.lt(part, 0, out=negative[: stop - start])
            dst = packed[start // 8 : _bytes.packed_bits_nbytes(stop)]
            dst.copy_(_bytes.pack_bits(bits))
        scale = check_finite_scalar(l1 / n if n else 0.0, "mean |x|")  # NaN/Inf propagate
        return packed, {"scale": scale}

    @classmethod
    def validate(cls, ct: CompressedTensor) -> None:
        scale = meta_float(ct, "scale")
        if scale < 0 or scale > 1e38:
            raise MalformedMessageError("sign scale must be in [0, 1e38]")
        expect_len(ct, _bytes.packed_bits_nbytes(ct.numel))

    @classmethod
    def decode(cls, ct: CompressedTensor, device: torch.device) -> torch.Tensor:
        scale = meta_float(ct, "scale")
        n = ct.numel
        packed = _bytes.view(ct.payload, torch.uint8, len(ct.payload))
        packed = packed.to(device) if device.type != "cpu" else packed
        out = torch.empty(n, device=device)
        scale_t = torch.tensor(scale, device=device)
        for start, stop in _bytes.spans(n, device):
            bits = _bytes.unpack_bits(packed[start // 8 :], stop - start)
            # bit 1 -> -scale, bit 0 -> +scale
            torch.add(scale_t, bits, alpha=-2.0 * scale, out=out[start:stop])
        return out


__all__ = ["TopK", "RandomK", "ScaledSign", "dgc_select", "random_k_indices", "density_to_k"]
