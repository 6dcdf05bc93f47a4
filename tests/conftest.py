"""Fixtures and settings for the whole suite."""

from __future__ import annotations

import os
import signal

# The suite runs three test processes and the peers they start on two cores, so threads wait
# for cores all the time. OpenMP's default lets an idle worker thread spin on its core for a
# while before it sleeps; torch's threads in the test processes, and in every process they
# start (which inherit this), then burn CPU the tests need. Measured with 5 heavy test files on
# 2 cores: 555 s of CPU and 331 s of wall time with the default, 471 s and 276 s with PASSIVE.
# The tutorial's first script (two torch threads) used 44 s of CPU in the suite, 7 s alone.
# OpenMP reads it when it is loaded (with torch; pytest loads this file before any test module)
# and a value the caller set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# A suite started in the background of a non-interactive shell, or under nohup, inherits an
# ignored SIGINT, and so would every peer a test starts: the tests that press Ctrl-C (the
# tutorial, the demos, the dashboard) would then wait for processes that cannot hear it.
# A handler (not SIG_IGN) is reset to the default in children when they exec.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
