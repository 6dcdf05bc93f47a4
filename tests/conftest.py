"""Fixtures and settings for the whole suite."""

from __future__ import annotations

import signal

# A suite started in the background of a non-interactive shell, or under nohup, inherits an
# ignored SIGINT, and so would every peer a test starts: the tests that press Ctrl-C (the
# tutorial, the demos, the dashboard) would then wait for processes that cannot hear it.
# A handler (not SIG_IGN) is reset to the default in children when they exec.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
