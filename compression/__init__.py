"""Tensor codecs, error feedback, two-way and adaptive compression. Depends on torch only."""
