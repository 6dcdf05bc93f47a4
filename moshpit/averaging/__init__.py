"""Averaging: matchmaking, Moshpit group keys, butterfly all-reduce and the ``Averager``.

Import ``moshpit.Averager`` / ``moshpit.StepResult`` (lazy) or from ``moshpit.averaging.averager``;
this package itself imports nothing heavy so that ``moshpit dht`` stays torch-free.
"""
