"""Moshpit rounds without the network: the paper's table from the production key rules.

Every peer holds a real :class:`moshpit.averaging.group_keys.GroupKeyManager`; each round the
peers that share a key form groups, and the keys move by the manager's own
``update_after_round`` (``group_position``) and ``update_without_group`` (the hole rule), and on
a grid without a size hint by its ``observe_declared`` / ``longer_key`` / ``observe_longer``
adaptation. Nothing of that is copied here: this file only decides who is in which group and
does the arithmetic of the averaging, so N = 4096 peers take seconds, not hours
(``sim_swarm.py`` runs the whole stack, DHT and all-reduce, at up to a few hundred peers).

What the driver models, and how:

- **Groups.** The live peers under a key, in a random order (who arrived first), form groups
  of up to ``target_group_size`` (a leader finalizes at ``M`` members; the rest form the next
  group); a group of one is no group. This is what matchmaking does once every peer's
  declaration is visible.
- **Declared counts.** A peer that read its key counts the live peers under it, itself
  included (``_CountingBackend.take_count``), at most ``MAX_CANDIDATES``.
- **Failures** (``p`` per peer per round), two semantics:
  ``sitout`` (the paper's): the failed peer takes no part, keeps its value and gets no group
  (``update_without_group``); with ``--failed-sees key`` it read its key first (it counts the
  peers there), with ``nothing`` (default) it read nothing (the averager then passes 1);
  ``midround`` (ours, ``docs/averaging.md`` "Failure semantics"): the peer was in its group
  and died at the start of the all-reduce: its contribution is missing from every part, the
  part it reduced keeps each member's local values, it keeps its own values, and every member
  (it too) moves its key by the group (``update_after_round``).
- **The wire is float32.** Values are float32 tensors (``--numel`` per peer); a group's mean is
  accumulated in float32 and written back as float32, as the all-reduce does with
  ``compression=None``. Rounding then bounds how small the variance gets (~1e-15, far below
  the paper's 1e-9).
- **Metrics.** The paper's: the variance of all peers' values (values start N(0, 1)) below
  ``1e-9``; and ours: the largest ``|x_i - mean|`` over peers and elements, relative to its
  value before round 1, below ``1e-6`` (``sim_swarm.py``'s tolerance). Rounds are capped at
  ``--max-rounds`` (50, as in the paper); a run that does not get there counts as the cap.
- **References.** ``paper``: a re-implementation of the paper's own simulation (N distinct
  random cells of the grid, fixed; round t averages along axis t mod 2; a failed peer sits
  out) in float64, to show this measures what the paper measured. ``allreduce``: all-reduce
  of everyone with restarts: the first round in which nobody fails, capped at 50.

Placements for our rules on a ``side x side`` grid (the key holds one coordinate):
``cells`` (the paper's: N distinct random cells; the key is the cell's row), ``lines`` (peer i
on line i mod side: every line equally full, as ``sim_swarm.py --grid`` places them),
``random`` (``expected_num_peers=N``: random key bits, the averager's default with a size
hint). ``cells`` and ``lines`` pass ``expected_num_peers=N`` with the bits too (a user who lays
out a grid knows its size; it gives the hole rule the first round's line length for a peer
cut off in that round); ``--no-size-hint`` leaves it out. ``--adaptive`` runs the grid
without a size hint (0 bits, grows with the estimates).

One JSON object per line: ``{"kind": "result", ...}`` per configuration (mean, standard
deviation, median, max, share above 8 rounds, next to the paper's number);
``--runs`` adds ``{"kind": "run", ...}`` per seed with the per-round variance.

    python benchmarks/sim_rounds.py                       # the whole table (~5-12 min)
    python benchmarks/sim_rounds.py --peers 512 --grid 32 --placement cells --seeds 50
    python benchmarks/sim_rounds.py --peers 1024 --group-size 32 --adaptive
    python benchmarks/sim_rounds.py --peers 48 --grid 8 --failure midround --runs
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moshpit.averaging.group_keys import GroupKeyManager, coordinate_bits  # noqa: E402
from moshpit.averaging.matchmaking import MAX_CANDIDATES  # noqa: E402

VARIANCE_TARGET = 1e-9  # the paper's: variance of all peers' values (they start N(0, 1))
ERROR_TARGET = 1e-6  # ours: max |x_i - mean| relative to its starting value
MAX_ROUNDS = 50  # the paper caps all-reduce with restarts here
MIN_GROUP_SIZE = 2  # the averager's default

# the paper's table (32 x 32 grid): rounds to variance < 1e-9, p = 0.01 and p = 0
PAPER = {
    (512, 0.01): 8.8,
    (768, 0.01): 6.9,
    (900, 0.01): 6.5,
    (512, 0.0): 8.2,
    (768, 0.0): 6.0,
    (900, 0.0): 5.0,
}


@dataclass(frozen=True)
class Config:
    peers: int
    group_size: int  # target_group_size M
    grid: int | None = None  # side of a d = 2 grid; None with adaptive
    placement: str = "lines"  # cells | lines | random (our rules on a grid)
    adaptive: bool = False  # no size hint: GroupKeyManager's adaptive grid
    fail: float = 0.01
    failure: str = "sitout"  # sitout | midround
    failed_sees: str = "nothing"  # nothing | key (sitout: what the failed peer read)
    numel: int = 1
    max_rounds: int = MAX_ROUNDS
    rotate: bool | str = "default"  # GroupKeyManager's rotate_lines ("default": its own)
    size_hint: bool = True  # cells / lines: also pass expected_num_peers = N with the bits
    key_bits: int | None = None  # keybits: peer i on key i mod 2**key_bits (any bit count)


@dataclass
class Run:
    seed: int
    variances: list[float]
    errors: list[float]
    steps_alone: int = 0  # peer-rounds without a group while not failed

    def rounds_to(self, series: Sequence[float], target: float, cap: int) -> int:
        return next((r for r, v in enumerate(series, 1) if v < target), cap)


def initial_values(n: int, numel: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, numel, generator=g, dtype=torch.float32)


def variance(values: torch.Tensor) -> float:
    """The paper's metric: the variance of all peers' values (per element, then averaged)."""
    return float(values.double().var(0, unbiased=False).mean())


def max_error(values: torch.Tensor, scale: float) -> float:
    """max_i |x_i - mean| over peers and elements, relative to ``scale`` (its value at the
    start). Around the peers' mean now: a round that fails halfway moves the mean."""
    xs = values.double()
    return float((xs - xs.mean(0)).abs().max()) / scale


def _bits(coordinate: int, side: int) -> str:
    return format(coordinate, f"0{coordinate_bits(side)}b")


def make_managers(cfg: Config, rng: random.Random) -> list[GroupKeyManager]:
    """One GroupKeyManager per peer, placed as ``cfg`` says."""
    m = cfg.group_size
    if cfg.adaptive:
        return [
            GroupKeyManager("sim", m, rng=random.Random(rng.random())) for _ in range(cfg.peers)
        ]
    if cfg.placement == "keybits":  # even lines over 2**B keys, B not a multiple of the
        # coordinate's bits: a key holds a coordinate and part of the one before
        b = int(cfg.key_bits or 0)
        return [
            GroupKeyManager(
                "sim", m, initial_group_bits=format(i % (1 << b), f"0{b}b") if b else "",
                rng=random.Random(rng.random()), adaptive=False,
            )
            for i in range(cfg.peers)
        ]  # fmt: skip
    side = cfg.grid or m
    if cfg.placement == "random":
        return [
            GroupKeyManager("sim", m, expected_num_peers=cfg.peers, rng=random.Random(rng.random()))
            for _ in range(cfg.peers)
        ]
    if cfg.placement == "cells":
        if cfg.peers > side * side:
            raise ValueError(f"{cfg.peers} peers do not fit {side} x {side} distinct cells")
        rows = [cell // side for cell in rng.sample(range(side * side), cfg.peers)]
    elif cfg.placement == "lines":
        rows = [i % side for i in range(cfg.peers)]
    else:
        raise ValueError(f"unknown placement {cfg.placement!r}")
    rotate = cfg.rotate if cfg.rotate != "default" else None
    return [
        GroupKeyManager(
            "sim",
            m,
            initial_group_bits=_bits(r, side),
            rng=random.Random(rng.random()),
            rotate_lines=rotate,
            expected_num_peers=cfg.peers if cfg.size_hint else None,
        )
        for r in rows
    ]


def average_groups(values: torch.Tensor, groups: list[list[int]]) -> None:
    """Every group's members get the group's mean: float32 in, accumulated in float32, out."""
    if not groups:
        return
    members = torch.tensor([i for g in groups for i in g])
    labels = torch.tensor([k for k, g in enumerate(groups) for _ in g])
    sums = torch.zeros(len(groups), values.shape[1], dtype=torch.float32)
    sums.index_add_(0, labels, values[members])
    counts = torch.tensor([len(g) for g in groups], dtype=torch.float32)
    values[members] = (sums / counts[:, None])[labels]


def average_with_dead(values: torch.Tensor, group: list[int], dead: set[int]) -> None:
    """The documented semantics of a member that dies at the start of the all-reduce: equal
    parts, one per member; the dead member's contribution is missing from every part, the
    part it reduced keeps each survivor's local values, and it keeps all of its own."""
    live = [i for i in group if i not in dead]
    numel = values.shape[1]
    bounds = [(numel * j // len(group), numel * (j + 1) // len(group)) for j in range(len(group))]
    for reducer, (lo, hi) in zip(group, bounds, strict=True):
        if reducer in dead or lo == hi or len(live) < 1:
            continue
        part = values[live, lo:hi]
        values[live, lo:hi] = part.sum(0, dtype=torch.float32) / len(live)


class RulesSwarm:
    """N peers' keys (real GroupKeyManagers) and float32 values, round by round."""

    def __init__(self, cfg: Config, seed: int, replay: Sequence[Sequence[int]] = ()):
        """``replay``: the peers that fail in rounds 1, 2, ... (``sim_swarm.py``'s ``cut``:
        the same failures as a run of the full stack); later rounds draw at ``cfg.fail``."""
        self.cfg = cfg
        self.replay = list(replay)
        self.rounds_done = 0
        self.rng = random.Random(seed)
        self.managers = make_managers(cfg, self.rng)
        self.values = initial_values(cfg.peers, cfg.numel, seed)
        x0 = self.values.double()
        self.scale = float((x0 - x0.mean(0)).abs().max())
        self.steps_alone = 0

    def form_groups(self, live: Iterable[int]) -> tuple[dict[str, list[int]], list[list[int]]]:
        """Peers per key (live ones), and the groups they form: arrival order at random,
        groups of up to M in that order; a group of one is no group."""
        by_key: dict[str, list[int]] = defaultdict(list)
        for i in live:
            by_key[self.managers[i].key].append(i)
        groups = []
        m = self.cfg.group_size
        for peers in by_key.values():
            order = list(peers)
            self.rng.shuffle(order)
            groups.extend(order[k : k + m] for k in range(0, len(order), m))
        return by_key, groups

    def follow_longer_keys(self, probes: dict[int, str | None], live: set[int]) -> None:
        """The probes read before declaring (``probe_before_declaring``): the counts are
        the live peers' keys as the round starts, before anyone moves."""
        early = [
            i for i, probe in probes.items()
            if probe is not None and i in live and self.managers[i].probe_before_declaring
        ]  # fmt: skip
        if not early:
            return
        at_start = defaultdict(int)
        for i in live:
            at_start[self.managers[i].key] += 1
        for i in early:
            manager, key = self.managers[i], probes[i]
            assert key is not None
            own = min(at_start[manager.key], MAX_CANDIDATES)
            candidates = [key, *manager.other_longer_keys()]
            count, best = max((min(at_start[k], MAX_CANDIDATES), k) for k in candidates)
            manager.follow_longer_now(count, own, best)

    def join_groups_with_room(
        self, by_key: dict[str, list[int]], groups: list[list[int]], failing: set[int]
    ) -> None:
        """A live peer alone under its key reads ``sibling_keys`` part way into the round and
        moves to a group there with room (``key_with_room``, ``move_sideways``), as
        ``grid_reads.find_group_on_grid`` does; the groups are the keys' as they formed, and
        the peers move one after another (the full stack spreads their looks in time)."""
        m = self.cfg.group_size
        by_first = {g[0]: g for g in groups}
        looking = {  # groups still looking part way in: 2 or more, room for one more
            self.managers[g[0]].key: g for g in groups if 2 <= len(g) < m
        }
        for g in [g for g in groups if len(g) == 1 and g[0] not in failing]:
            i = g[0]
            manager = self.managers[i]
            room = [(len(looking[k]), k) for k in manager.sibling_keys() if k in looking]
            key = manager.key_with_room(room)
            if key is None:
                continue
            by_key[manager.key].remove(i)
            manager.move_sideways(key)
            by_key[key].append(i)
            looking[key].append(i)
            groups.remove(by_first[i])
            if len(looking[key]) >= m:
                del looking[key]

    def round(self) -> None:
        cfg, n = self.cfg, self.cfg.peers
        failing = {i for i in range(n) if self.rng.random() < cfg.fail}
        if self.rounds_done < len(self.replay):
            failing = set(self.replay[self.rounds_done])
        self.rounds_done += 1
        in_groups = set(range(n)) - failing if cfg.failure == "sitout" else set(range(n))
        # adaptive grids: one round in PROBE_EVERY a peer also counts a longer key's peers;
        # a new or lonely one does it before declaring, and follows them at once when its
        # own key is empty (it reads the declarations of the keys as the round starts)
        probes = {i: self.managers[i].longer_key() for i in range(n)}
        self.follow_longer_keys(probes, in_groups)
        by_key, groups = self.form_groups(sorted(in_groups))
        self.join_groups_with_room(by_key, groups, failing)
        counts = {key: min(len(peers), MAX_CANDIDATES) for key, peers in by_key.items()}
        keys_before = [m.key for m in self.managers]

        def declared(i: int) -> int:
            # a failed peer that read nothing counts itself only, as take_count does (the hole
            # rule reads a count of 1 as no count: GroupKeyManager._line_length)
            if i in failing and cfg.failure == "sitout":
                if cfg.failed_sees == "nothing":
                    return 1
                return min(counts.get(keys_before[i], 0) + 1, MAX_CANDIDATES)
            return max(1, counts.get(keys_before[i], 0))

        for i, probe in probes.items():
            if probe is not None and not (i in failing and cfg.failed_sees == "nothing"):
                self.managers[i].observe_longer(counts.get(probe, 0), declared(i))
        real = [g for g in groups if len(g) >= MIN_GROUP_SIZE]
        if cfg.failure == "midround":
            for g in real:
                dead = failing.intersection(g)
                if dead:
                    average_with_dead(self.values, g, dead)
            average_groups(self.values, [g for g in real if not failing.intersection(g)])
        else:
            average_groups(self.values, real)
        grouped = set()
        for g in real:
            group_id = self.rng.randbytes(16)
            for i in g:
                self.managers[i].update_after_round(group_id, g, i, declared(i))
                grouped.add(i)
        for i in range(n):
            if i not in grouped:
                if i not in failing:
                    self.steps_alone += 1
                self.managers[i].update_without_group(declared(i))

    def run(self, seed: int) -> Run:
        variances, errors = [], []
        for _ in range(self.cfg.max_rounds):
            self.round()
            variances.append(variance(self.values))
            errors.append(max_error(self.values, self.scale))
            if variances[-1] < VARIANCE_TARGET and errors[-1] < ERROR_TARGET:
                break
        return Run(seed, variances, errors, self.steps_alone)


def paper_run(peers: int, side: int, fail: float, seed: int, cap: int = MAX_ROUNDS) -> Run:
    """The paper's simulation, re-implemented (not our rules): N distinct random cells of a
    side x side grid, fixed; round t averages every line along axis t mod 2; a failed peer
    sits the round out and keeps its value. float64 throughout."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    cells = rng.sample(range(side * side), peers)
    coords = [(c % side, c // side) for c in cells]
    x = torch.randn(peers, generator=g, dtype=torch.float64)
    scale = float((x - x.mean()).abs().max())
    variances, errors = [], []
    for t in range(cap):
        live = [i for i in range(peers) if rng.random() >= fail]
        axis = 1 - t % 2  # peers that share this coordinate form a line
        lines: dict[int, list[int]] = defaultdict(list)
        for i in live:
            lines[coords[i][axis]].append(i)
        for line in lines.values():
            idx = torch.tensor(line)
            x[idx] = x[idx].mean()
        variances.append(float(x.var(unbiased=False)))
        errors.append(float((x - x.mean()).abs().max()) / scale)
        if variances[-1] < VARIANCE_TARGET and errors[-1] < ERROR_TARGET:
            break
    return Run(seed, variances, errors)


def allreduce_run(peers: int, fail: float, seed: int, cap: int = MAX_ROUNDS) -> Run:
    """All-reduce of all N peers with restarts: a round in which anyone fails is lost (the
    paper's baseline); the first clean round gives everyone the float32 mean."""
    rng = random.Random(seed)
    values = initial_values(peers, 1, seed)
    x0 = values.double()
    scale = float((x0 - x0.mean(0)).abs().max())
    variances, errors = [], []
    for _ in range(cap):
        if all(rng.random() >= fail for _ in range(peers)):
            average_groups(values, [list(range(peers))])
        variances.append(variance(values))
        errors.append(max_error(values, scale))
        if variances[-1] < VARIANCE_TARGET:
            break
    return Run(seed, variances, errors)


def summarize(rounds: list[int]) -> dict:
    return {
        "mean": round(statistics.fmean(rounds), 2),
        "std": round(statistics.pstdev(rounds), 2),
        "min": min(rounds),
        "median": statistics.median(rounds),
        "max": max(rounds),
    }


def result(model: str, cfg: Config, runs: list[Run], seconds: float) -> dict:
    cap = cfg.max_rounds
    by_var = [r.rounds_to(r.variances, VARIANCE_TARGET, cap) for r in runs]
    by_err = [r.rounds_to(r.errors, ERROR_TARGET, cap) for r in runs]
    row = {
        "kind": "result",
        "model": model,
        **asdict(cfg),
        "seeds": len(runs),
        "rounds_to_variance_1e-9": summarize(by_var),
        "rounds_to_max_error_1e-6": summarize(by_err),
        "share_above_8_rounds": round(sum(r > 8 for r in by_var) / len(runs), 3),
        "not_reached_in_cap": sum(not any(v < VARIANCE_TARGET for v in r.variances) for r in runs),
        "paper_rounds": PAPER.get((cfg.peers, cfg.fail)) if cfg.grid == 32 else None,
        "steps_alone_per_round": round(
            statistics.fmean(r.steps_alone / max(1, len(r.variances)) for r in runs), 3
        ),
        "wall_s": round(seconds, 2),
    }
    if model != "ours":
        for key in ("placement", "adaptive", "failure", "failed_sees", "numel", "group_size"):
            row.pop(key)
    return row


def read_replay(path: str) -> dict[int, list[list[int]]]:
    """Per seed, the peers cut in each round of a ``sim_swarm.py`` run (its JSON lines)."""
    cuts: dict[int, list[list[int]]] = defaultdict(list)
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        if row.get("kind") == "round" and "cut" in row:
            cuts[row["seed"]].append(row["cut"])
    return dict(cuts)


def measure(
    model: str,
    cfg: Config,
    seeds: Sequence[int],
    runs_out: bool = False,
    replay: dict[int, list[list[int]]] | None = None,
) -> dict:
    t0 = time.perf_counter()
    runs = []
    for seed in seeds:
        if replay is not None:
            run = RulesSwarm(cfg, seed, replay[seed]).run(seed)
        elif model == "paper":
            run = paper_run(cfg.peers, cfg.grid or cfg.group_size, cfg.fail, seed, cfg.max_rounds)
        elif model == "allreduce":
            run = allreduce_run(cfg.peers, cfg.fail, seed, cfg.max_rounds)
        else:
            run = RulesSwarm(cfg, seed).run(seed)
        runs.append(run)
        if runs_out:
            print(json.dumps({"kind": "run", "model": model, **asdict(cfg), "seed": seed,
                              "variances": [float(f"{v:.3g}") for v in run.variances],
                              "steps_alone": run.steps_alone}), flush=True)  # fmt: skip
    return result(model, cfg, runs, time.perf_counter() - t0)


def table(seeds: Sequence[int], fail: float) -> Iterable[tuple[str, Config]]:
    """The configurations of docs/averaging.md's table."""
    for peers in (512, 768, 900):
        base = Config(peers, 32, grid=32, fail=fail)
        yield "paper", base
        for placement in ("cells", "lines", "random"):
            yield "ours", Config(peers, 32, grid=32, placement=placement, fail=fail)
        yield "ours", Config(peers, 32, grid=32, placement="cells", fail=fail, failed_sees="key")
        yield "ours", Config(peers, 32, grid=32, placement="cells", fail=fail,
                             failure="midround", numel=32)  # fmt: skip
        yield "allreduce", base
    for peers in (32, 48, 56):  # the paper's fill ratios on 8 x 8
        yield "ours", Config(peers, 8, grid=8, placement="cells", fail=fail)
        yield "ours", Config(peers, 8, grid=8, placement="lines", fail=fail)
    for m in (32, 16, 8):
        yield "ours", Config(1024, m, adaptive=True, placement="none", fail=fail)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--peers", type=int, default=None, help="one configuration (default: table)")
    p.add_argument("--grid", type=int, default=None, help="side of a d = 2 grid")
    p.add_argument("--group-size", type=int, default=None, help="M (default: the grid's side)")
    p.add_argument("--placement", choices=["cells", "lines", "random"], default="cells")
    p.add_argument("--adaptive", action="store_true", help="no size hint (default grid)")
    p.add_argument(
        "--key-bits", type=int, default=None,
        help="instead of a grid: peer i on key i mod 2**B, B key bits (e.g. 6 for 1024 peers "
        "in groups of 16: 64 keys of one group each)",
    )  # fmt: skip
    p.add_argument("--model", choices=["ours", "paper", "allreduce"], default="ours")
    p.add_argument("--fail", type=float, default=0.01, help="per peer per round")
    p.add_argument("--failure", choices=["sitout", "midround"], default="sitout")
    p.add_argument("--failed-sees", choices=["nothing", "key"], default="nothing")
    p.add_argument(
        "--rotate", choices=["default", "yes", "no"], default="default",
        help="GroupKeyManager rotate_lines (default: rotate unless the bits are given)",
    )  # fmt: skip
    p.add_argument(
        "--no-size-hint", action="store_true",
        help="cells / lines: give the bits without expected_num_peers (the hole rule then "
        "has no line length for a peer cut off in the first round)",
    )  # fmt: skip
    p.add_argument("--numel", type=int, default=None, help="elements per peer (midround: 32)")
    p.add_argument("--seeds", type=int, default=20, help="seeds 0..n-1")
    p.add_argument("--max-rounds", type=int, default=MAX_ROUNDS)
    p.add_argument("--runs", action="store_true", help="also one line per seed")
    p.add_argument(
        "--replay", default=None,
        help="sim_swarm.py's output: its seeds, and in each round the peers it cut",
    )  # fmt: skip
    args = p.parse_args(argv)
    seeds = range(args.seeds)
    if args.peers is None:
        for model, cfg in table(seeds, args.fail):
            print(json.dumps(measure(model, cfg, seeds, args.runs)), flush=True)
        return
    if args.adaptive + (args.grid is not None) + (args.key_bits is not None) != 1:
        p.error("give one of --grid SIDE, --key-bits B or --adaptive")
    numel = args.numel or (32 if args.failure == "midround" else 1)
    cfg = Config(
        args.peers,
        args.group_size or args.grid,
        grid=args.grid,
        placement="none"
        if args.adaptive
        else "keybits"
        if args.key_bits is not None
        else args.placement,
        adaptive=args.adaptive,
        fail=args.fail,
        failure=args.failure,
        failed_sees=args.failed_sees,
        numel=numel,
        max_rounds=args.max_rounds,
        rotate={"default": "default", "yes": True, "no": False}[args.rotate],
        size_hint=not args.no_size_hint,
        key_bits=args.key_bits,
    )
    if cfg.group_size is None or math.isnan(cfg.group_size):
        p.error("--adaptive needs --group-size")
    replay = read_replay(args.replay) if args.replay else None
    if replay is not None:
        seeds = sorted(replay)
    print(json.dumps(measure(args.model, cfg, seeds, args.runs, replay)), flush=True)


if __name__ == "__main__":
    main()
