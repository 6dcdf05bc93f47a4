"""Exception types raised by the compression library.

Every failure to encode or decode raises a subclass of :class:`CompressionError`, so callers
that handle untrusted messages can catch one type and drop the offending peer's data.
"""

from __future__ import annotations


class CompressionError(ValueError):
    """Base class: a tensor could not be compressed or a message could not be decoded."""


class UnknownCodecError(CompressionError):
    """The message names a codec id that this version does not know."""


class MalformedMessageError(CompressionError):
    """The message structure is wrong: missing fields, wrong types, bad dtype or meta."""


class SizeLimitError(CompressionError):
    """The declared shape exceeds the caller's ``max_numel`` (a shape bomb) or a hard cap."""


class PayloadSizeError(MalformedMessageError):
    """The payload length differs from what the codec expects for the declared shape/meta."""


class PayloadValueError(MalformedMessageError):
    """The payload's content is invalid: indices out of range, non-finite scales, etc."""


class NonFiniteInputError(CompressionError):
    """A quantizing or sparsifying codec was given NaN or +-Inf (see docs/compression.md)."""
