"""The writer of the checkpoint kill -9 fuzz test (tests/training/test_checkpoint_fuzz.py).

Run as ``python checkpoint_writer.py DIR``: a fork server. It imports torch once, then for each
``fork`` line on stdin forks a child that saves the states A, B, A, B, ... into DIR forever
(printing ``commit A`` / ``commit B`` after each commit), prints ``pid N``, waits for that child
to die (the test SIGKILLs it at a random moment) and prints ``exited N STATUS``. Forking
avoids paying the torch import for each of the many kill points.
"""

from __future__ import annotations

import os
import sys

import torch

# The kill -9 fuzz needs saves that take tens of milliseconds so that kills land mid-write:
# ~12 MiB in big tensors (1 MiB chunks, written loose). Tensor "shared" is the same in A and B
# (its chunks are written once), the rest differ, plus an empty tensor and a small non-float
# one, and 32 small tensors that go into a pack: 8 of them the same in A and B, so each commit
# leaves the other state's pack a quarter live and garbage collection repacks it.
SMALL = 32
SMALL_SHARED = 8
SHAPES = {
    "shared": (256, 1024),
    "w1": (512, 1024),
    "w2": (1024, 1024),
    "w3": (700, 1000),
    "small": (17,),
    "empty": (0, 4),
}


def make_states() -> dict[str, list[tuple[str, torch.Tensor]]]:
    """States A and B, the same in every process (seeded)."""
    states: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for label, seed in (("A", 1), ("B", 2)):
        gen = torch.Generator().manual_seed(seed)
        named = []
        for name, shape in SHAPES.items():
            if name == "shared":
                tensor = torch.randn(shape, generator=torch.Generator().manual_seed(0))
            elif name == "small":
                tensor = torch.randint(0, 1000, shape, generator=gen, dtype=torch.int64)
            else:
                tensor = torch.randn(shape, generator=gen)
            named.append((name, tensor))
        for i in range(SMALL):
            small_gen = torch.Generator().manual_seed(100 + i + (0 if i < SMALL_SHARED else seed))
            named.append((f"norm{i}.weight", torch.randn(64 + 8 * i, generator=small_gen)))
        states[label] = named
    return states


EPOCHS = {"A": 1, "B": 2}


def run_child(directory: str, states: dict[str, list[tuple[str, torch.Tensor]]]) -> None:
    from moshpit.training.errors import CheckpointError
    from moshpit.training.store import StateStore, save_state

    # keep=1: every commit garbage-collects the other state's chunks and the next one writes
    # them again, so kills also land in collection and in rewrites of deleted chunks
    store = StateStore(directory, keep=1)
    # start with the state that is not committed, so that every save writes chunks
    try:
        label = "B" if store.latest().metadata.get("state") == "A" else "A"
    except CheckpointError:
        label = "A"
    while True:
        save_state(store, states[label], EPOCHS[label], {"state": label})
        os.write(1, f"commit {label}\n".encode())
        label = "B" if label == "A" else "A"


def main() -> None:
    directory = sys.argv[1]
    torch.set_num_threads(1)  # no OpenMP pool in the parent: fork stays safe
    states = make_states()
    os.write(1, b"ready\n")
    for line in sys.stdin:
        if line.strip() != "fork":
            continue
        pid = os.fork()
        if pid == 0:
            try:
                run_child(directory, states)
            except BaseException as e:
                os.write(2, f"writer child failed: {e!r}\n".encode())
            finally:
                os._exit(3)
        os.write(1, f"pid {pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        os.write(1, f"exited {pid} {status}\n".encode())


if __name__ == "__main__":
    main()
