"""Dense codecs that keep every value: raw, half precision, bfloat16, scaled half precision.

NaN/Inf policy (see docs/compression.md): NoCompression and BFloat16 carry NaN and +-Inf
through unchanged; Float16 saturates +-Inf and out-of-range values to +-65504 and keeps NaN;
ScaledFloat16 rejects non-finite input with NonFiniteInputError (its scale would be Inf/NaN).
"""

from __future__ import annotations

import math

import torch

from . import _bytes
from .base import (
    EXACT_DTYPES,
    FLOAT_DTYPES,
    Codec,
    CompressedTensor,
    MetaValue,
    check_finite_scalar,
    expect_len,
    meta_float,
)

FP16_MAX = 65504.0
# Scales are powers of two so that multiplying by them is exact; this range keeps both the
# scale and its reciprocal representable in float32.
_MIN_SCALE_EXP, _MAX_SCALE_EXP = -100, 100


def _to_device(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A fresh tensor (never an alias of the read-only payload) on ``device``."""
    if device.type == "cpu":
        return t.to(dtype=dtype, copy=True)
    return t.to(device=device, non_blocking=False).to(dtype)


def pow2_scale(absmax: float, target_exp: int = 15) -> float:
    """Power-of-two scale s with ``absmax / s < 2**target_exp`` (1.0 for an all-zero input)."""
    if absmax == 0.0:
        return 1.0
    _, exp = math.frexp(absmax)  # absmax = m * 2**exp, 0.5 <= m < 1
    return math.ldexp(1.0, min(max(exp - target_exp, _MIN_SCALE_EXP), _MAX_SCALE_EXP))


def encode_scaled_fp16(values: torch.Tensor, buf: bytearray, offset: int) -> float:
    """Write ``values`` as float16 of ``values / scale`` into ``buf``; returns the scale."""
    absmax = check_finite_scalar(values.abs().amax(), "absmax") if values.numel() else 0.0
    scale = pow2_scale(absmax)
    if values.numel():
        dst = torch.frombuffer(buf, dtype=torch.float16, count=values.numel(), offset=offset)
        if values.device.type == "cpu":
            torch.mul(values.reshape(-1), 1.0 / scale, out=dst)
        else:
            dst.copy_((values.reshape(-1).float() * (1.0 / scale)).half())
    return scale


class NoCompression(Codec):
    """Raw little-endian bytes in the tensor's own dtype (lossless, any listed dtype)."""

    codec_id = 0
    lossy = False
    allowed_dtypes = frozenset(EXACT_DTYPES)

    def encode(self, tensor: torch.Tensor) -> tuple[bytearray, dict[str, MetaValue]]:
        buf = _bytes.writable(tensor.numel() * tensor.element_size())
        _bytes.write(buf, 0, tensor.contiguous())
        return buf, {}

    @classmethod
    def validate(cls, ct: CompressedTensor) -> None:
        itemsize = torch.empty((), dtype=EXACT_DTYPES[ct.dtype]).element_size()
        expect_len(ct, ct.numel * itemsize)

    @classmethod
    def decode(cls, ct: CompressedTensor, device: torch.device) -> torch.Tensor:
        dtype = EXACT_DTYPES[ct.dtype]
        return _to_device(_bytes.view(ct.payload, dtype, ct.numel), device, dtype)


class Float16(Codec):
    """IEEE half precision; values beyond +-65504 (and +-Inf) saturate, NaN stays NaN."""

    codec_id = 1

    def encode(self, tensor: torch.Tensor) -> tuple[bytearray, dict[str, MetaValue]]:
        flat = tensor.reshape(-1)
        buf = _bytes.writable(2 * flat.numel())
        if flat.numel():
            dst = torch.frombuffer(buf, dtype=torch.float16)
            # cast straight into the payload buffer (out-of-range values become +-inf),
            # then saturate in place: cheaper than clamping the wider input first
            dst.copy_(flat)
            dst.clamp_(-FP16_MAX, FP16_MAX)
        return buf, {}

    @classmethod
    def validate(cls, ct: CompressedTensor) -> None:
        expect_len(ct, 2 * ct.numel)

    @classmethod
    def decode(cls, ct: CompressedTensor, device: torch.device) -> torch.Tensor:
        return _to_device(_bytes.view(ct.payload, torch.float16, ct.numel), device, torch.float32)


class BFloat16(Codec):
    """bfloat16 (float32's exponent range, 8-bit mantissa); NaN and +-Inf pass through."""

    codec_id = 2

    def encode(self, tensor: torch.Tensor) -> tuple[bytearray, dict[str, MetaValue]]:
        flat = tensor.reshape(-1)
        buf = _bytes.writable(2 * flat.numel())
        if flat.numel():
            torch.frombuffer(buf, dtype=torch.bfloat16).copy_(flat)
        return buf, {}

    @classmethod
    def validate(cls, ct: CompressedTensor) -> None:
        expect_len(ct, 2 * ct.numel)

    @classmethod
    def decode(cls, ct: CompressedTensor, device: torch.device) -> torch.Tensor:
        return _to_device(_bytes.view(ct.payload, torch.bfloat16, ct.numel), device, torch.float32)


class ScaledFloat16(Codec):
    """float16 of ``x / s`` with a power-of-two scale ``s`` chosen from max|x|.

    Unlike plain Float16 nothing overflows and tiny tensors (e.g. late-training gradients
    around 1e-7) keep full half precision instead of flushing into fp16 subnormals.
    """

    codec_id = 3

    def encode(self, tensor: torch.Tensor) -> tuple[bytearray, dict[str, MetaValue]]:
        buf = _bytes.writable(2 * tensor.numel())
        scale = encode_scaled_fp16(tensor.reshape(-1), buf, 0)
        return buf, {"scale": scale}

    @classmethod
    def validate(cls, ct: CompressedTensor) -> None:
        meta_float(ct, "scale", positive=True)
        expect_len(ct, 2 * ct.numel)

    @classmethod
    def decode(cls, ct: CompressedTensor, device: torch.device) -> torch.Tensor:
        scale = meta_float(ct, "scale", positive=True)
        out = _to_device(_bytes.view(ct.payload, torch.float16, ct.numel), device, torch.float32)
        return out.mul_(scale)


__all__ = ["NoCompression", "Float16", "BFloat16", "ScaledFloat16", "FLOAT_DTYPES"]
