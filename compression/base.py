"""The codec interface, the wire message and dispatch by codec id.

A :class:`CompressedTensor` is what travels: a stable integer codec id, the original dtype
name and shape, one ``bytes`` payload and a small ``meta`` dict of scalars. Decoding never
trusts any of it: :meth:`CompressedTensor.from_msg` checks structure, ids, dtype, shape
(against ``max_numel``) and the payload length the codec expects *before* anything is
allocated, and the codec validates content (index ranges, finite scales) while decoding.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from . import _bytes
from .errors import (
    CompressionError,
    MalformedMessageError,
    NonFiniteInputError,
    PayloadSizeError,
    SizeLimitError,
    UnknownCodecError,
)

#: Default cap on the element count of one decoded tensor (512 MiB of float32).
DEFAULT_MAX_NUMEL = 2**27
MAX_NDIM = 32
MAX_DIM = 2**31 - 1
MAX_META_ITEMS = 16

FLOAT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
#: Dtypes a lossless codec may carry in addition to floats.
EXACT_DTYPES: dict[str, torch.dtype] = {
    **FLOAT_DTYPES,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in EXACT_DTYPES.items()}

MetaValue = int | float | bool | str | None


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise CompressionError(f"unsupported dtype {dtype}") from None


@dataclass(frozen=True)
class CompressedTensor:
    """A compressed tensor as it travels: msgpack-ready through :meth:`to_msg`."""

    codec_id: int
    dtype: str
    shape: tuple[int, ...]
    #: bytes from the wire; locally produced messages hold a zero-copy ``memoryview`` of
    #: the encoder's buffer (msgpack packs both as ``bin``; ``bytes(payload)`` if needed)
    payload: bytes | bytearray | memoryview
    meta: dict[str, MetaValue] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of payload (what dominates the wire size)."""
        return len(self.payload)

    def to_msg(self) -> dict[str, Any]:
        """A dict of msgpack-native types; the payload travels as msgpack ``bin``."""
        return {
            "codec": self.codec_id,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "payload": self.payload,
            "meta": dict(self.meta),
        }

    @classmethod
    def from_msg(cls, msg: Any, max_numel: int = DEFAULT_MAX_NUMEL) -> CompressedTensor:
        """Parse and validate an untrusted message (e.g. straight out of msgpack).

        Raises a :class:`CompressionError` subclass on anything unexpected; the check of the
        payload length against shape and meta happens here, before any tensor is allocated.
        """
        if not isinstance(msg, dict):
            raise MalformedMessageError(f"expected a dict, got {type(msg).__name__}")
        expected = {"codec", "dtype", "shape", "payload", "meta"}
        if set(msg) != expected:
            raise MalformedMessageError(
                f"message fields {sorted(map(str, msg))} != {sorted(expected)}"
            )
        codec_id = msg["codec"]
        if type(codec_id) is not int:
            raise MalformedMessageError("codec id must be an int")
        codec_cls = codec_class(codec_id)
        dtype = msg["dtype"]
        if not isinstance(dtype, str) or dtype not in codec_cls.allowed_dtypes:
            raise MalformedMessageError(
                f"dtype {dtype!r} not allowed for {codec_cls.__name__} "
                f"(allowed: {sorted(codec_cls.allowed_dtypes)})"
            )
        shape = _parse_shape(msg["shape"], max_numel)
        payload = msg["payload"]
        if isinstance(payload, memoryview) and not (
            payload.ndim == 1 and payload.itemsize == 1 and payload.c_contiguous
        ):
            raise MalformedMessageError("a memoryview payload must be flat bytes")
        if not isinstance(payload, bytes | bytearray | memoryview):
            raise MalformedMessageError("payload must be bytes")
        meta = _parse_meta(msg["meta"])
        ct = cls(codec_id, dtype, shape, payload, meta)
        codec_cls.validate(ct)
        codec_cls.check_content(ct)
        return ct


def _parse_shape(raw: Any, max_numel: int) -> tuple[int, ...]:
    if not isinstance(raw, list | tuple):
        raise MalformedMessageError("shape must be a list of ints")
    if len(raw) > MAX_NDIM:
        raise MalformedMessageError(f"shape has {len(raw)} dims (max {MAX_NDIM})")
    for dim in raw:
        if type(dim) is not int or not 0 <= dim <= MAX_DIM:
            raise MalformedMessageError(
                f"shape entries must be ints in [0, {MAX_DIM}], got {dim!r}"
            )
    numel = math.prod(raw)  # at most 32 factors below 2**31: cheap, exact Python ints
    if numel > max_numel:
        raise SizeLimitError(f"shape {raw!r} has more than max_numel={max_numel} elements")
    return tuple(raw)


def _parse_meta(raw: Any) -> dict[str, MetaValue]:
    if not isinstance(raw, dict):
        raise MalformedMessageError("meta must be a dict")
    if len(raw) > MAX_META_ITEMS:
        raise MalformedMessageError(f"meta has {len(raw)} items (max {MAX_META_ITEMS})")
    for key, value in raw.items():
        if not isinstance(key, str) or len(key) > 32:
            raise MalformedMessageError(f"meta key {key!r} is not a short string")
        if value is not None and not isinstance(value, int | float | bool | str):
            raise MalformedMessageError(f"meta[{key!r}] has unsupported type")
        if isinstance(value, str) and len(value) > 64:
            raise MalformedMessageError(f"meta[{key!r}] string too long")
    return dict(raw)


def meta_int(ct: CompressedTensor, key: str, lo: int, hi: int) -> int:
    """An integer meta field in ``[lo, hi]`` (validated; bools are rejected)."""
    value = ct.meta.get(key)
    if type(value) is not int or not lo <= value <= hi:
        raise MalformedMessageError(f"meta[{key!r}]={value!r} must be an int in [{lo}, {hi}]")
    return value


def meta_float(ct: CompressedTensor, key: str, *, positive: bool = False) -> float:
    """A finite float meta field (ints accepted; msgpack may turn 1.0 into 1 elsewhere)."""
    value = ct.meta.get(key)
    if not isinstance(value, (int, float)) or type(value) is bool or not math.isfinite(value):
        raise MalformedMessageError(f"meta[{key!r}]={value!r} must be a finite number")
    if positive and not value > 0:
        raise MalformedMessageError(f"meta[{key!r}]={value!r} must be positive")
    return float(value)


def expect_len(ct: CompressedTensor, nbytes: int) -> None:
    if len(ct.payload) != nbytes:
        raise PayloadSizeError(
            f"codec {ct.codec_id} payload for shape {list(ct.shape)} must be {nbytes} bytes, "
            f"got {len(ct.payload)}"
        )


_REGISTRY: dict[int, type[Codec]] = {}


class Codec(abc.ABC):
    """Turns a tensor into a :class:`CompressedTensor` and back.

    Subclasses that travel on the wire set a unique, stable ``codec_id`` and implement
    :meth:`encode` (any device, vectorized) and the classmethods :meth:`validate` (cheap,
    before allocation) and :meth:`decode` (parameters come only from the message, so any
    peer decodes without knowing the sender's settings).
    """

    codec_id: ClassVar[int] = -1
    lossy: ClassVar[bool] = True
    allowed_dtypes: ClassVar[frozenset[str]] = frozenset(FLOAT_DTYPES)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cid = cls.__dict__.get("codec_id")
        if cid is not None and cid >= 0:
            if cid in _REGISTRY and _REGISTRY[cid] is not cls:
                raise RuntimeError(f"codec id {cid} registered twice")
            _REGISTRY[cid] = cls

    def compress(self, tensor: torch.Tensor, **kwargs: Any) -> CompressedTensor:
        """Compress ``tensor`` (CPU or CUDA, any supported dtype, any shape).

        Keyword arguments are per-call codec options (e.g. ``seed=`` for RandomK).
        """
        name = dtype_name(tensor.dtype)
        if name not in self.allowed_dtypes:
            raise CompressionError(f"{type(self).__name__} does not accept {tensor.dtype}")
        encoded, meta = self.encode(tensor.detach(), **kwargs)
        payload = _bytes.payload(encoded) if isinstance(encoded, torch.Tensor) else encoded
        return CompressedTensor(self.codec_id, name, tuple(tensor.shape), payload, meta)

    def decompress(
        self, ct: CompressedTensor, device: torch.device | str | None = None
    ) -> torch.Tensor:
        return decompress(ct, device)

    def roundtrip(
        self, tensor: torch.Tensor, **kwargs: Any
    ) -> tuple[CompressedTensor, torch.Tensor]:
        """Compress and return also the tensor a receiver will decode (float32 for lossy
        codecs, on ``tensor``'s device). Error feedback needs both."""
        ct = self.compress(tensor, **kwargs)
        return ct, _decode_float(ct, tensor.device)

    @abc.abstractmethod
    def encode(self, tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, MetaValue]]:
        """Payload (a CPU uint8 tensor, see ``_bytes.alloc``) and meta for ``tensor``."""

    @classmethod
    def check_content(cls, ct: CompressedTensor) -> None:
        """Content checks that need to read the payload (index ranges, scales stored in the
        payload). Called by ``from_msg`` after :meth:`validate`; decoders check again.
        Most codecs have nothing to check here: any byte is a valid code."""
        return None

    @classmethod
    @abc.abstractmethod
    def validate(cls, ct: CompressedTensor) -> None:
        """Check meta and exact payload length for ``ct.shape``; raise before allocating."""

    @classmethod
    @abc.abstractmethod
    def decode(cls, ct: CompressedTensor, device: torch.device) -> torch.Tensor:
        """A flat float tensor (float32, or the original dtype when exact) of ``ct.numel``."""

    @classmethod
    def decode_into(cls, ct: CompressedTensor, out: torch.Tensor) -> None:
        """Decode (validated) ``ct`` into the flat tensor ``out`` of ``ct.numel`` elements,
        cast to its dtype. Codecs whose payload is already a tensor override this to skip
        the intermediate tensor."""
        out.copy_(cls.decode(ct, out.device).reshape(-1))

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({params})"


def codec_class(codec_id: int) -> type[Codec]:
    try:
        return _REGISTRY[codec_id]
    except (KeyError, TypeError):
        raise UnknownCodecError(
            f"unknown codec id {codec_id!r} (known: {sorted(_REGISTRY)})"
        ) from None


def codec_from_id(codec_id: int) -> Codec:
    """A default-configured instance of the codec with this wire id (decoding needs no
    configuration: everything it needs is in the message)."""
    return codec_class(codec_id)()


def _decode_float(ct: CompressedTensor, device: torch.device | str | None) -> torch.Tensor:
    cls = codec_class(ct.codec_id)
    cls.validate(ct)
    flat = cls.decode(ct, torch.device(device) if device is not None else torch.device("cpu"))
    if flat.numel() != ct.numel:  # a codec bug, not bad input
        raise CompressionError(f"codec {ct.codec_id} decoded {flat.numel()} != {ct.numel}")
    return flat.view(ct.shape)


def decompress(ct: CompressedTensor, device: torch.device | str | None = None) -> torch.Tensor:
    """Decode ``ct`` into a tensor of its original dtype and shape on ``device`` (CPU default).

    Dispatches on ``ct.codec_id``; raises :class:`CompressionError` subclasses for unknown
    codecs or invalid content. Note: floats carried in a payload (NoCompression, Float16, ...)
    are not scanned for NaN/Inf here; see docs/compression.md for the per-codec policy.
    """
    if ct.dtype not in EXACT_DTYPES:
        raise MalformedMessageError(f"unknown dtype {ct.dtype!r}")
    out = _decode_float(ct, device)
    return out.to(EXACT_DTYPES[ct.dtype])


def decompress_into(ct: CompressedTensor, out: torch.Tensor) -> None:
    """Decode ``ct`` straight into ``out`` (``ct.numel`` elements, any float dtype; values are
    cast to it): what :func:`decompress` then a copy would give, minus the temporary tensor.
    Same validation and errors as :func:`decompress`."""
    if ct.dtype not in EXACT_DTYPES:
        raise MalformedMessageError(f"unknown dtype {ct.dtype!r}")
    if out.numel() != ct.numel:
        raise ValueError(f"out has {out.numel()} elements, the message {ct.numel}")
    cls = codec_class(ct.codec_id)
    cls.validate(ct)
    cls.decode_into(ct, out.view(-1))


_F32_MAX = float(torch.finfo(torch.float32).max)


def check_finite_scalar(value: torch.Tensor | float, what: str) -> float:
    """Turn a reduction result into a float, raising if the input had NaN/Inf (or, for
    float64 input, values that float32 arithmetic cannot represent)."""
    v = float(value)
    if not math.isfinite(v):
        raise NonFiniteInputError(
            f"{what} is {v}: the input contains NaN or Inf; this codec rejects non-finite "
            "values (clean or clip the tensor first, or use NoCompression/Float16)"
        )
    if abs(v) > _F32_MAX:
        raise NonFiniteInputError(f"{what} is {v}: beyond float32, which this codec computes in")
    return v
