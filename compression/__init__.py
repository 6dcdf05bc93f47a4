"""Tensor codecs, error feedback, two-way and adaptive compression. Depends on torch only.

See docs/compression.md for wire formats, the NaN/Inf policy of each codec and benchmarks.
"""

from .adaptive import GraVAC, RoleAdaptive, SizeAdaptive, compression_gain, exponential_factors
from .base import (
    DEFAULT_MAX_NUMEL,
    Codec,
    CompressedTensor,
    codec_from_id,
    decompress,
    decompress_into,
)
from .dgc import DGCMomentum, dgc_density_schedule
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
from .quantization import Blockwise4Bit, Blockwise8Bit, Quantile8Bit, Uniform8Bit
from .sparse import RandomK, ScaledSign, TopK, dgc_select, random_k_indices
from .sparse2bit import TopK2Bit

__all__ = [
    "DEFAULT_MAX_NUMEL",
    "Codec",
    "CompressedTensor",
    "codec_from_id",
    "decompress",
    "decompress_into",
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
    "Uniform8Bit",
    "Quantile8Bit",
    "Blockwise8Bit",
    "Blockwise4Bit",
    "TopK",
    "TopK2Bit",
    "RandomK",
    "ScaledSign",
    "dgc_select",
    "random_k_indices",
    "SizeAdaptive",
    "RoleAdaptive",
    "GraVAC",
    "compression_gain",
    "exponential_factors",
    "DGCMomentum",
    "dgc_density_schedule",
]
