"""The compression of one all-reduce round, both ways (chunks sent, results of our part).

Kept apart from the round (``allreduce_round.py``): it only knows codecs, error-feedback keys
and what each call costs, nothing of streams or peers.
"""

from __future__ import annotations

import dataclasses
import threading

import torch

from compression import Codec, CompressedTensor, NoCompression, TwoWayCompression
from moshpit.averaging.allreduce_protocol import raw_float32

CODEC_PASSES = 4  # rough passes of a codec's compress (cast/scale/pack) per element


class RoundCodecs:
    """The two directions of compression for one round (error-feedback keys = flat ranges)."""

    def __init__(self, compression: TwoWayCompression | Codec | None) -> None:
        if compression is None:
            compression = NoCompression()
        if not isinstance(compression, (TwoWayCompression, Codec)):
            raise TypeError(
                f"compression must be a TwoWayCompression, Codec or None, not {type(compression).__name__}"
            )
        self.spec = compression
        # Uncompressed float32 needs no codec call: the payload is a view of the values
        self.raw = type(compression) is NoCompression
        # Codecs and error-feedback state are not promised to be thread-safe (RNG state, the
        # residual dict), and chunks are compressed in several worker threads at once.
        self._lock = threading.Lock()

    def cost(self, numel: int) -> int:
        """Rough work of compressing ``numel`` elements in element-passes (0: a view)."""
        return 0 if self.raw else CODEC_PASSES * numel

    def reduced_cost(self, numel: int) -> int:
        """Rough work of :meth:`reduced`: the codec's, plus one copy of the payload."""
        return self.cost(numel) + numel

    def send(self, values: torch.Tensor, key: tuple[int, int]) -> CompressedTensor:
        """Compress a chunk to send; ``values`` must stay unmodified until it is sent."""
        if self.raw and values.dtype == torch.float32 and values.device.type == "cpu":
            return raw_float32(values)
        with self._lock:
            if isinstance(self.spec, TwoWayCompression):
                return self.spec.compress_send(values, key)
            return self.spec.compress(values)

    def reduced(
        self, values: torch.Tensor, key: tuple[int, int]
    ) -> tuple[CompressedTensor, torch.Tensor]:
        """The result message of a reduced chunk and the float32 values receivers decode.

        The payload is made immutable ``bytes`` once: the same result goes to every sender, and
        the transport copies a mutable buffer (memoryview) on every send but sends ``bytes``
        as they are, so this is one copy instead of one per remote sender.
        """
        if self.raw:  # lossless: receivers decode exactly ``values`` (float32 from the aggregator)
            ct, decoded = raw_float32(values), values
        else:
            with self._lock:
                if isinstance(self.spec, TwoWayCompression):
                    ct, decoded = self.spec.reducer.compress_with_decoded(values, key)
                else:
                    ct, decoded = self.spec.roundtrip(values)
            decoded = decoded.reshape(-1).to(torch.float32)
        if not isinstance(ct.payload, bytes):
            ct = dataclasses.replace(ct, payload=bytes(ct.payload))
        return ct, decoded
