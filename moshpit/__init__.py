"""moshpit: decentralized volunteer training for PyTorch.

The public API is imported lazily so that torch-free commands (``moshpit dht`` on a tiny
bootstrap VM) never pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    "DHT": "dht.facade",
    "DHTNode": "dht.kademlia.node",
    "Averager": "moshpit.averaging.averager",
    "StepResult": "moshpit.averaging.step_result",
    "AveragerConfig": "moshpit.averaging.config",
    "Optimizer": "moshpit.training.optimizer",
    "SyncOptions": "moshpit.training.modes.options",
    "LocalOptions": "moshpit.training.modes.options",
    "DiLoCoOptions": "moshpit.training.modes.options",
    "TrainingStateAverager": "moshpit.training.state_averager",
    "StateAveragerOptions": "moshpit.training.state_options",
    "ProgressTracker": "moshpit.training.progress",
    "handle_preemption": "moshpit.training.preemption",
    "Preempted": "moshpit.training.preemption",
    "serve_metrics": "moshpit.metrics",
    # the errors a training script may want to catch, with one import
    "StateError": "moshpit.training.errors",
    "StateMismatchError": "moshpit.training.errors",
    "CheckpointError": "moshpit.training.errors",
    "CheckpointDirInUseError": "moshpit.training.errors",
    "NoDonorError": "moshpit.training.errors",
    "StateDownloadError": "moshpit.training.errors",
    "NonFiniteStateError": "moshpit.training.health",
    "AveragingError": "moshpit.averaging.errors",
    "AveragerLockError": "moshpit.averaging.averager",
    "BootstrapError": "dht.kademlia.errors",
    "IdentityInUseError": "dht.p2p.errors",
    "MultiaddrError": "dht.p2p.errors",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'moshpit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
