"""The training layer: training state, checkpoints, state sharing, progress, preemption.

See docs/training-state.md. Imports go ``moshpit.training -> moshpit.averaging, dht``.
"""
