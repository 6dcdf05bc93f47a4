"""The send rate a peer's own all-reduce rounds reach, for peers that stated no bandwidth.

A round's time allowance grows with the bytes its slowest member has to send
(``Averager.allreduce_budget``), but only members that state a ``bandwidth`` say how slow
they are. A volunteer at home rarely does: at 200 kbit/s a 4-bit round of 2.2M values needs
~75 s, and with the benchmark's 30-s allreduce timeout every round failed, for good. So each
averager that states nothing reports what it saw: the bytes its connections to the group
carried during a round (the ``Host``'s counters, whole messages or not) over the round's
seconds. That is a lower bound of its uplink (a round also waits for others, and for the
codecs), so it sizes only the time allowance, never parts, chunks or pacing; the largest of
the last few readings is the tightest bound. A round cut by the allowance still
counts: what it sent by then is the rate, and the next round gets time for its bytes. A round
that left a member out before its time was up does not: it mostly waited for that member
(a dead one is cut by the stall limits, which a low reading would stretch).
"""

from __future__ import annotations

from collections import deque

__all__ = ["UplinkMeter"]

READINGS = 4  # rounds whose rates are kept: one slow round (a dead member waited out) fades


class UplinkMeter:
    """Recent rounds' send rates (bytes/s); :attr:`rate` is the largest, or None."""

    def __init__(self, readings: int = READINGS):
        self._rates: deque[float] = deque(maxlen=readings)

    def observe(
        self, bytes_sent: int, seconds: float, *, timed_out: bool = False, lost: bool = False
    ) -> None:
        """One round sent ``bytes_sent`` bytes in ``seconds``. No reading where it sent
        nothing (it never reached the links), or where it ``lost`` a member before its time
        ran out (``timed_out`` False): it waited for that member more than it sent."""
        if bytes_sent > 0 and seconds > 0 and (timed_out or not lost):
            self._rates.append(bytes_sent / seconds)

    @property
    def rate(self) -> float | None:
        return max(self._rates) if self._rates else None
