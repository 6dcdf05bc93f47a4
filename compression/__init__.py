"""Tensor codecs, error feedback, two-way and adaptive compression. Depends on torch only.

See docs/compression.md for wire formats, the NaN/Inf policy of each codec and benchmarks.
"""

from .base import (
    DEFAULT_MAX_NUMEL,
    Codec,
    CompressedTensor,
    codec_from_id,
    decompress,
)
from .errors import (
    CompressionError,
    MalformedMessageError,
    NonFiniteInputError,
    PayloadSizeError,
    PayloadValueError,
    SizeLimitError,
    UnknownCodecError,
)
from .feedback import ErrorFeedback, TwoWayCompression
from .floating import BFloat16, Float16, NoCompression, ScaledFloat16

__all__ = [
    "DEFAULT_MAX_NUMEL",
    "Codec",
    "CompressedTensor",
    "codec_from_id",
    "decompress",
    "CompressionError",
    "MalformedMessageError",
    "NonFiniteInputError",
    "PayloadSizeError",
    "PayloadValueError",
    "SizeLimitError",
    "UnknownCodecError",
    "ErrorFeedback",
    "TwoWayCompression",
    "NoCompression",
    "Float16",
    "BFloat16",
    "ScaledFloat16",
]
