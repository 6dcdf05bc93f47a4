"""Dense codecs that keep every value: raw, half precision, bfloat16, scaled half precision.

NaN/Inf policy (see docs/compression.md): NoCompression and BFloat16 carry NaN and +-Inf
through unchanged; Float16 saturates +-Inf and out-of-range values to +-65504 and keeps NaN;
ScaledFloat16 rejects non-finite input with NonFiniteInputError (its scale would be Inf/NaN).
"""

from __future__ import annotations

import math
from typing import ClassVar

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
from .errors import MalformedMessageError, PayloadValueError

FP16_MAX = 65504.0
# Scales are powers of two so that multiplying by them is exact; this range keeps both the
# scale and its reciprocal representable in float32.
_MIN_SCALE_EXP, _MAX_SCALE_EXP = -100, 100


def fresh_on(view: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A new tensor (never an alias of the read-only payload) on ``device``.

    Narrow payload data crosses to an accelerator before it is widened.
    """
    if device.type == "cpu":
        return view.to(dtype=dtype, copy=True)
    return view.to(device=device).to(dtype)


def pow2_scale(absmax: float, target_exp: int = 15) -> float:
    """Power-of-two scale s with ``absmax / s < 2**target_exp`` (1.0 for an all-zero input)."""
    if absmax == 0.0:
        return 1.0
    _, exp = math.frexp(absmax)  # absmax = m * 2**exp, 0.5 <= m < 1
    return math.ldexp(1.0, min(max(exp - target_exp, _MIN_SCALE_EXP), _MAX_SCALE_EXP))


def validate_pow2_scale(ct: CompressedTensor) -> float:
    scale = meta_float(ct, "scale", positive=True)
    mant, exp = math.frexp(scale)
    if mant != 0.5 or not _MIN_SCALE_EXP <= exp - 1 <= _MAX_SCALE_EXP:
        raise MalformedMessageError(f"scale {scale} is not a power of two in 2**[-100, 100]")
    return scale


def absmax_of(flat: torch.Tensor) -> float:
    """max |x| without a tensor-sized temporary; NonFiniteInputError on NaN/Inf."""
    if flat.numel() == 0:
        return 0.0
    lo, hi = torch.aminmax(flat)
    return max(-check_finite_scalar(lo, "min"), check_finite_scalar(hi, "max"))


def encode_scaled_fp16(values: torch.Tensor, dst: torch.Tensor) -> float:
    """Write float16 of ``values / scale`` into the float16 tensor ``dst``; returns the scale."""
    flat = values.reshape(-1)
    scale = pow2_scale(absmax_of(flat))
    n = flat.numel()
    if n:
        # multiply in float32 (exact: power of two), then cast; a mixed-dtype out= would
        # take a slow non-vectorized path
        tmp = torch.empty(_bytes.scratch_len(n, flat.device), device=flat.device)
        for start, stop in _bytes.spans(n, flat.device):
            part = torch.mul(flat[start:stop], 1.0 / scale, out=tmp[: stop - start])
            dst[start:stop].copy_(part)
    return scale


def _within_fp16(flat: torch.Tensor) -> bool:
    """Cheap proof that no element exceeds +-65504 (nor is NaN): the sum of squares is at
    most 65504**2 (one dot product: ~5x faster than min/max on CPU). False only means
    "not proven": the caller then checks exactly."""
    if flat.dtype not in (torch.float32, torch.float64) or flat.device.type != "cpu":
        return False
    return float(torch.dot(flat, flat)) <= FP16_MAX * FP16_MAX


class NoCompression(Codec):
    """Raw little-endian bytes in the tensor's own dtype (lossless, any listed dtype)."""

    codec_id = 0
    lossy = False
    allowed_dtypes = frozenset(EXACT_DTYPES)

    def encode(self, tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, MetaValue]]:
        # always a private copy: the caller may modify its tensor while the message waits
        raw = torch.empty(tensor.shape, dtype=tensor.dtype)
        raw.copy_(tensor)
        return raw.reshape(-1).view(torch.uint8), {}

    @classmethod
    def validate(cls, ct: CompressedTensor) -> None:
        itemsize = torch.empty((), dtype=EXACT_DTYPES[ct.dtype]).element_size()
        expect_len(ct, ct.numel * itemsize)
        if ct.dtype == "bool" and ct.numel:
            # torch reads any nonzero byte as a bool it then mishandles (3 is "True" but not
            # equal to True); a sender's torch only ever writes 0 and 1
            largest = int(_bytes.view(ct.payload, torch.uint8, ct.numel).max())
            if largest > 1:
                raise PayloadValueError(
                    f"a bool payload holds byte {largest}: only 0 and 1 are bools"
                )

    @classmethod
    def decode(cls, ct: CompressedTensor, device: torch.device) -> torch.Tensor:
        dtype = EXACT_DTYPES[ct.dtype]
        return fresh_on(_bytes.view(ct.payload, dtype, ct.numel), device, dtype)

    @classmethod
    def decode_into(cls, ct: CompressedTensor, out: torch.Tensor) -> None:
        out.copy_(_bytes.view(ct.payload, EXACT_DTYPES[ct.dtype], ct.numel))


class _HalfPrecision(Codec):
    """Two bytes a value in ``half_dtype``; decodes to float32."""

    half_dtype: ClassVar[torch.dtype]

    @classmethod
    def validate(cls, ct: CompressedTensor) -> None:
        expect_len(ct, 2 * ct.numel)

    @classmethod
    def decode(cls, ct: CompressedTensor, device: torch.device) -> torch.Tensor:
        return fresh_on(_bytes.view(ct.payload, cls.half_dtype, ct.numel), device, torch.float32)

    @classmethod
    def decode_into(cls, ct: CompressedTensor, out: torch.Tensor) -> None:
        out.copy_(_bytes.view(ct.payload, cls.half_dtype, ct.numel))  # one widening copy


class Float16(_HalfPrecision):
    """IEEE half precision; values beyond +-65504 (and +-Inf) saturate, NaN stays NaN."""

    codec_id = 1
    half_dtype = torch.float16

    def encode(self, tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, MetaValue]]:
        flat = tensor.reshape(-1)
        n = flat.numel()
        buf = _bytes.alloc(2 * n)
        if n:
            dst = _bytes.typed(buf, torch.float16, n)
            dst.copy_(flat)  # cast straight into the payload (out-of-range becomes +-inf)
            if flat.dtype != torch.float16 and not _within_fp16(flat):
                lo, hi = (float(v) for v in torch.aminmax(flat))
                if not -FP16_MAX <= lo <= hi <= FP16_MAX:  # also true when NaN is present
                    dst.clamp_(-FP16_MAX, FP16_MAX)
        return buf, {}


class BFloat16(_HalfPrecision):
    """bfloat16 (float32's exponent range, 8-bit mantissa); NaN and +-Inf pass through."""

    codec_id = 2
    half_dtype = torch.bfloat16

    def encode(self, tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, MetaValue]]:
        flat = tensor.reshape(-1)
        buf = _bytes.alloc(2 * flat.numel())
        if flat.numel():
            _bytes.typed(buf, torch.bfloat16, flat.numel()).copy_(flat)
        return buf, {}


class ScaledFloat16(Codec):
    """float16 of ``x / s`` with a power-of-two scale ``s`` chosen from max|x|.

    Unlike plain Float16 nothing overflows and tiny tensors (e.g. late-training gradients
    around 1e-7) keep full half precision instead of flushing into fp16 subnormals.
    """

    codec_id = 3

    def encode(self, tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, MetaValue]]:
        n = tensor.numel()
        buf = _bytes.alloc(2 * n)
        scale = encode_scaled_fp16(tensor, _bytes.typed(buf, torch.float16, n))
        return buf, {"scale": scale}

    @classmethod
    def validate(cls, ct: CompressedTensor) -> None:
        validate_pow2_scale(ct)
        expect_len(ct, 2 * ct.numel)

    @classmethod
    def decode(cls, ct: CompressedTensor, device: torch.device) -> torch.Tensor:
        scale = validate_pow2_scale(ct)
        out = fresh_on(_bytes.view(ct.payload, torch.float16, ct.numel), device, torch.float32)
        return out.mul_(scale) if scale != 1.0 else out


__all__ = ["NoCompression", "Float16", "BFloat16", "ScaledFloat16", "FLOAT_DTYPES"]
