"""Moshpit averaging at scale, by simulation: N real peers in one process, virtual time.

Every peer is the production stack: a Kademlia ``DHTNode`` on its own libp2p ``Host``
(Noise + yamux) and a ``moshpit.averaging.Averager`` with the library's default timeouts,
all in one trio loop on ``dht.p2p.MemoryNetwork`` under ``trio.testing.MockClock``
(``autojump_threshold=0``): whenever every task waits, the clock jumps to the next deadline,
so timeouts and link delays cost no wall time, only the CPU work does.

The network (:class:`WanNetwork`) gives each address an access link drawn once from a seeded
RNG: a one-way delay of 5-50 ms (so a path's RTT, twice the sum of both ends' delays, lies in
20-200 ms) and a bandwidth log-uniform in 10-1000 Mbit/s. A path has the two delays summed and
the smaller bandwidth. ``MemoryNetwork`` times every chunk on these links (serialized per
direction, bounded buffers), as it does for a uniform network.

Failures: in every round each peer fails with probability ``p``. A failed peer is cut off at a
uniformly random moment of the first ``fail_window`` seconds of the round (all its links go
down: open connections stall, new dials are refused, exactly as ``MemoryNetwork.partition``
does), and comes back when the round is over. It still runs its own ``step()``, unaware,
so its partners see what a crashed or disconnected machine looks like and time out on it.

What cannot run on the virtual clock: worker threads. The averager moves CPU work to threads
only above ``THREAD_MIN_NUMEL`` (4M element-passes) and copies results in a thread above
``WRITE_INLINE_NUMEL`` (32768 elements); the simulated tensor (``--numel``, default 4096
float32) stays below both, so everything runs on the loop. The DHT's signature checks move to
threads when there are many; ``open_swarm`` keeps them on the loop
(``max_signatures_on_loop``), as the memory-network tests do.

One JSON object per line: ``{"kind": "round", ...}`` per round (error, failures, group sizes,
virtual and wall seconds) and ``{"kind": "result", ...}`` per run (rounds to ``--tolerance``,
wall seconds per peer, peak RSS).

    nice -n 10 python benchmarks/sim_swarm.py --peers 512 --grid 32 --fail 0.01 --seeds 0 1 2
    nice -n 10 python benchmarks/sim_swarm.py --peers 1024 --fail 0.01     # default grid
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import resource
import sys
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import trio
import trio.testing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.sim_rounds import MIN_GROUP_SIZE, VARIANCE_TARGET, average_groups  # noqa: E402
from dht.kademlia.clock import dht_clock, trio_clock  # noqa: E402
from dht.kademlia.simulation import Swarm, open_swarm  # noqa: E402
from dht.p2p import MemoryNetwork  # noqa: E402
from dht.p2p.memory import LinkConfig  # noqa: E402
from moshpit.averaging.averager import Averager  # noqa: E402
from moshpit.averaging.step_result import StepResult  # noqa: E402

MBIT = 1e6 / 8  # bytes per second
JOIN_CONCURRENCY = 16


class WanNetwork(MemoryNetwork):
    """A MemoryNetwork whose links differ: per-address access delay and bandwidth.

    Links set explicitly (``set_link``/``partition``) still win; a peer in ``down`` has every
    link down (``cut``/``restore`` wake the stalled streams, as ``set_link`` does).
    """

    def __init__(
        self,
        seed: int,
        one_way_delay: tuple[float, float] = (0.005, 0.050),
        mbits: tuple[float, float] = (10.0, 1000.0),
    ) -> None:
        super().__init__()
        self._seed = seed
        self._delay = one_way_delay
        self._log_bw = (math.log(mbits[0] * MBIT), math.log(mbits[1] * MBIT))
        self._access: dict[int, tuple[float, float]] = {}
        self._paths: dict[tuple[int, int], LinkConfig] = {}
        self.down: set[int] = set()

    def access(self, port: int) -> tuple[float, float]:
        """(one-way delay s, bandwidth B/s) of one address, drawn once from (seed, port)."""
        got = self._access.get(port)
        if got is None:
            rng = random.Random(self._seed * 1_000_003 + port)
            got = (rng.uniform(*self._delay), math.exp(rng.uniform(*self._log_bw)))
            self._access[port] = got
        return got

    def _link(self, a: int, b: int) -> LinkConfig:
        explicit = self._links.get(frozenset((a, b)))
        if explicit is not None:
            return explicit
        if a in self.down or b in self.down:
            return LinkConfig(0.0, None, False)
        key = (a, b) if a < b else (b, a)
        path = self._paths.get(key)
        if path is None:
            (da, ba), (db, bb) = self.access(a), self.access(b)
            path = self._paths[key] = LinkConfig(da + db, min(ba, bb), True)
        return path

    def cut(self, port: int) -> None:
        self.down.add(port)
        self._wake_all()

    def restore(self) -> None:
        self.down.clear()
        self._wake_all()


def port_of(node) -> int:
    return node.host.listen_addrs[0].without_peer_id().memory_id()


def grid_bits(n: int, side: int) -> list[str]:
    """Initial key bits putting peer i on line i % side of a side x side grid (d = 2)."""
    bits = max(1, (side - 1).bit_length())
    return [format(i % side, f"0{bits}b") for i in range(n)]


def initial_values(n: int, numel: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return list(torch.randn(n, numel, generator=g, dtype=torch.float32))


class MatchmakingEvents(logging.Handler):
    """Counts what matchmaking logs at DEBUG about lost leaders: a follower whose leader
    went silent (cut off) or sent no group by the deadline looks on, late in the round."""

    EVENTS = {
        "leader %s silent for %.1fs: looking on": "leader_silent",
        "leader %s did not send a group in time": "leader_late",
        "join request to %s timed out": "join_timed_out",
    }

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.counts: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        name = self.EVENTS.get(record.msg) if isinstance(record.msg, str) else None
        if name is not None:
            self.counts[name] += 1

    @classmethod
    def install(cls) -> MatchmakingEvents:
        handler = cls()
        log = logging.getLogger("moshpit.averaging.matchmaking")
        log.setLevel(logging.DEBUG)
        log.addHandler(handler)
        log.propagate = False  # the DEBUG lines themselves go nowhere
        return handler


def paper_variance(values: torch.Tensor) -> float:
    """The paper's metric (as ``sim_rounds.variance``): the variance of all peers' values
    around their mean now, per element, averaged over elements; values start N(0, 1)."""
    return float(values.double().var(0, unbiased=False).mean())


def histogram(sizes: Sequence[int]) -> dict[str, int]:
    return {str(k): v for k, v in sorted(Counter(sizes).items())}


def rules_view(
    keys: Sequence[str],
    before: torch.Tensor,
    failing: set[int],
    results: Sequence[StepResult],
    index: dict,
    m: int,
    rng: random.Random,
    cut_before: set[int] | None = None,  # the peers cut in the round before
    last_groups: Sequence[Sequence[int]] = (),  # the groups formed in the round before
) -> dict:
    """What ``sim_rounds.py``'s rules would do with this round's keys and failures, next to
    what the stack did: the peers declared per key, the groups the rules form (live peers
    under a key, in groups of up to ``m``; a failed peer sits out) and the groups that
    formed, the variance after each, and why each live peer without an averaged step lost
    it. ``before``: the values at the start of the round (float32, one row per peer)."""
    by_key: dict[str, list[int]] = defaultdict(list)
    for i, key in enumerate(keys):
        by_key[key].append(i)
    predicted: list[list[int]] = []
    for peers in by_key.values():
        live = [i for i in peers if i not in failing]
        rng.shuffle(live)
        predicted.extend(live[k : k + m] for k in range(0, len(live), m))
    predicted = [g for g in predicted if len(g) >= MIN_GROUP_SIZE]
    after = before.clone()
    average_groups(after, predicted)
    formed: dict[bytes, list[int]] = {}
    for r in results:
        if r.group_id is not None:
            formed[r.group_id] = [index[p] for p in r.members]
    lost: Counter[str] = Counter()
    for i, r in enumerate(results):
        if i in failing:
            continue
        if r.group_id is None:
            # a cut peer under our key: our leader (or one we waited on) may have been it
            live = [j for j in by_key[keys[i]] if j not in failing]
            if len(live) < MIN_GROUP_SIZE:
                lost["no_group, alone under the key (the rules too)"] += 1
            elif len(live) < len(by_key[keys[i]]):
                lost["no_group, a cut peer under the key"] += 1
            elif cut_before and cut_before.intersection(live):
                lost["no_group, a peer cut last round under the key"] += 1
            else:
                lost["no_group, in time"] += 1
        elif not r.succeeded:
            cut = failing.intersection(formed[r.group_id])
            lost["group failed, a cut member" if cut else "group failed"] += 1
        elif r.complete_fraction < 1.0:
            lost["partial, a cut member"] += 1
    # keys whose live peers the rules put in fewer groups than formed there (a split)
    rules_groups = Counter(keys[g[0]] for g in predicted)
    formed_groups = Counter(keys[g[0]] for g in formed.values())
    # the groups that formed, had their cut members sat out (as the rules' failures do): the
    # gap to the rules is matchmaking's, the gap from here to the result the all-reduce's
    as_formed = before.clone()
    live_groups = [[i for i in g if i not in failing] for g in formed.values()]
    average_groups(as_formed, [g for g in live_groups if len(g) >= MIN_GROUP_SIZE])
    # pairs of this round's groups that were in one group the round before too: random
    # groups of m out of n repeat ~(m - 1) / (n - 1) of them, a grid's next axis none
    last = {i: k for k, g in enumerate(last_groups) for i in g}
    pairs = repeats = 0
    for g in formed.values():
        for a in range(len(g)):
            for b in range(a + 1, len(g)):
                pairs += 1
                repeats += g[a] in last and last.get(g[a]) == last.get(g[b])
    return {
        "groups": [sorted(g) for g in formed.values()],
        "repeated_pairs": round(repeats / pairs, 3) if pairs else None,
        "declared_per_key": histogram([len(p) for p in by_key.values()]),
        "rules_group_sizes": histogram([len(g) for g in predicted]),
        "formed_group_sizes": histogram([len(g) for g in formed.values()]),
        "cut_in_formed_groups": sum(len(failing.intersection(g)) for g in formed.values()),
        "split_keys": sum(formed_groups[k] > rules_groups[k] for k in formed_groups),
        "lost": dict(sorted(lost.items())),
        "rules_paper_variance": paper_variance(after),
        "formed_paper_variance": paper_variance(as_formed),
    }


@dataclass
class Sim:
    swarm: Swarm
    net: WanNetwork  # or a plain MemoryNetwork (then no failures can be injected)
    averagers: list[Averager]
    values: list[torch.Tensor]
    mean: torch.Tensor  # the global mean, float64, of the initial values
    scale: float  # max |x_i - mean| at the start
    rng: random.Random
    target_group_size: int = 32
    events: MatchmakingEvents | None = None
    variance0: float = 1.0
    history: list[dict] = field(default_factory=list)

    def error(self) -> float:
        """max over peers and coordinates of |x_i - mean|, relative to its starting value."""
        xs = torch.stack([t.double() for t in self.values])
        return float((xs - self.mean).abs().max()) / self.scale

    def consensus_error(self) -> float:
        """max |x_i - mean of the x_i now|, relative: how far the peers are from agreeing."""
        xs = torch.stack([t.double() for t in self.values])
        return float((xs - xs.mean(0)).abs().max()) / self.scale

    def drift(self) -> float:
        """max |mean now - mean at the start|, relative. A round that fails halfway moves the
        mean: a member that sent its part but missed the result keeps its old value while the
        others take the average, so the sum is not kept."""
        xs = torch.stack([t.double() for t in self.values])
        return float((xs.mean(0) - self.mean).abs().max()) / self.scale

    def variance(self) -> float:
        """Mean over peers of ||x_i - mean||^2, relative to its starting value."""
        xs = torch.stack([t.double() for t in self.values])
        return float(((xs - self.mean) ** 2).sum(1).mean()) / self.variance0

    async def round(
        self, fail: float, fail_window: float, gap: float = 0.0, cut: Sequence[int] = ()
    ) -> dict:
        """One step() by every peer; each fails (is cut off mid-round) with probability fail.

        ``gap``: virtual seconds everyone waits first (local compute between rounds).
        ``cut``: peers that fail this round for sure (tests).
        """
        await trio.sleep(gap)
        n = len(self.averagers)
        failing = [i for i in range(n) if self.rng.random() < fail or i in cut]
        keys = [a.keys.key for a in self.averagers]
        before = torch.stack(self.values).clone()
        if self.events is not None:
            self.events.counts.clear()
        results: list = [None] * n
        t0, w0, c0 = trio.current_time(), time.perf_counter(), time.process_time()

        done_at: dict[int, float] = {}

        async def step(i: int) -> None:
            results[i] = await self.averagers[i].astep()
            done_at[i] = trio.current_time()

        async def fail_later(i: int, delay: float) -> None:
            await trio.sleep(delay)
            self.net.cut(port_of(self.swarm.nodes[i]))

        async with trio.open_nursery() as nursery:
            cut_delay = {i: self.rng.uniform(0, fail_window) for i in failing}
            for i, delay in cut_delay.items():
                nursery.start_soon(fail_later, i, delay)
            for i in range(n):
                nursery.start_soon(step, i)
        if isinstance(self.net, WanNetwork):
            self.net.restore()
        sizes = [r.group_size for r in results if r.succeeded]
        index = {node.host.peer_id: i for i, node in enumerate(self.swarm.nodes)}
        # a peer cut after its step was over failed nobody (its round had ended)
        hit = {i for i in failing if i not in done_at or done_at[i] > t0 + cut_delay[i]}
        view = rules_view(
            keys, before, hit, results, index, self.target_group_size,
            random.Random(len(self.history)),  # not self.rng: the failures stay as they were
            set(self.history[-1]["cut"]) if self.history else set(),
            self.history[-1]["groups"] if self.history else (),
        )  # fmt: skip
        variance_before = paper_variance(before)
        row = {
            "kind": "round",
            "peers": n,
            "round": len(self.history) + 1,
            "error": self.error(),
            "consensus_error": self.consensus_error(),
            "drift": self.drift(),
            "variance": self.variance(),
            "paper_variance": paper_variance(torch.stack(self.values)),
            "factor": paper_variance(torch.stack(self.values)) / variance_before,
            "rules_factor": view["rules_paper_variance"] / variance_before,
            "formed_factor": view["formed_paper_variance"] / variance_before,
            "failed_peers": len(failing),
            "cut_before_done": len(hit),
            "cut": sorted(hit),  # sim_rounds.py --replay runs the rules with these failures
            "alone": [i for i, r in enumerate(results) if not r.succeeded and i not in hit],
            "steps_failed": n - len(sizes),
            "mean_group_size": sum(sizes) / max(1, len(sizes)),
            "steps_alone": sum(
                1 for i, r in enumerate(results) if not r.succeeded and i not in hit
            ),
            **view,
            "matchmaking_events": dict(self.events.counts) if self.events is not None else {},
            "reasons": sorted({r.reason for r in results if not r.succeeded})[:3],
            "virtual_s": round(trio.current_time() - t0, 3),
            "wall_s": round(time.perf_counter() - w0, 2),
            "cpu_s": round(time.process_time() - c0, 2),
        }
        self.history.append(row)
        return row


@asynccontextmanager
async def open_sim(
    n: int,
    *,
    seed: int,
    numel: int = 4096,
    grid: int | None = None,
    target_group_size: int | None = None,
    net: MemoryNetwork | None = None,
    **averager_kwargs,
) -> AsyncIterator[Sim]:
    """``n`` DHT nodes + Averagers on a WanNetwork; call inside ``dht_clock(trio_clock)``.

    ``grid``: put the peers on a ``grid x grid`` grid (initial_group_bits and expected_num_peers,
    groups of ``grid``);
    None: the averager's defaults (no hints; ``target_group_size`` default 32).
    """
    net = WanNetwork(seed) if net is None else net
    values = initial_values(n, numel, seed)
    mean = torch.stack([v.double() for v in values]).mean(0)
    scale = float((torch.stack([v.double() for v in values]) - mean).abs().max())
    bits = grid_bits(n, grid) if grid else [None] * n
    m = target_group_size or grid or 32
    async with open_swarm(1, memory_network=net, seed=seed) as swarm:
        # the others join JOIN_CONCURRENCY at a time, each through a random earlier node: a
        # swarm forming at once. One by one, 64 peers took 245 s of virtual time, and every
        # open connection pays for its keepalive pings all along
        while len(swarm.nodes) < n:
            batch = min(JOIN_CONCURRENCY, n - len(swarm.nodes))
            async with trio.open_nursery() as nursery:
                for _ in range(batch):
                    nursery.start_soon(swarm.add)
        averagers = [
            Averager(
                [values[i]],
                dht=node,
                prefix="sim",
                target_group_size=m,
                initial_group_bits=bits[i],
                # the grid's size too, as a user who lays out a grid can: the hole rule's line
                # length for a peer cut off in the first round (GroupKeyManager._line_length)
                expected_num_peers=n if grid else None,
                **averager_kwargs,
            )
            for i, node in enumerate(swarm.nodes)
        ]
        sim = Sim(swarm, net, averagers, values, mean, scale, random.Random(seed), m)
        sim.variance0 = sim.variance()
        try:
            yield sim
        finally:
            for a in averagers:
                a.shutdown()


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


async def run_one(args: argparse.Namespace, seed: int) -> dict:
    w0, c0 = time.perf_counter(), time.process_time()
    with dht_clock(trio_clock):
        async with open_sim(
            args.peers,
            seed=seed,
            numel=args.numel,
            grid=args.grid,
            target_group_size=args.group_size,
        ) as sim:
            sim.events = MatchmakingEvents.install()
            setup_wall = time.perf_counter() - w0
            setup_virtual = trio.current_time()
            setup_cpu = time.process_time() - c0
            print(json.dumps({"kind": "setup", "peers": args.peers, "seed": seed,
                              "wall_s": round(setup_wall, 2), "cpu_s": round(setup_cpu, 2)}),
                  flush=True)  # fmt: skip
            reached = None
            for r in range(1, args.max_rounds + 1):
                row = await sim.round(args.fail, args.fail_window, args.gap)
                row["seed"] = seed
                print(json.dumps(row), flush=True)
                if row["error"] <= args.tolerance and reached is None:
                    reached = r
                # once the peers agree, later rounds cannot undo a drift of the mean
                agree = row["consensus_error"] <= args.tolerance or args.until_variance
                if agree and row["paper_variance"] < VARIANCE_TARGET and not args.keep_going:
                    break
            total_wall = time.perf_counter() - w0
            total_cpu = time.process_time() - c0
            return {
                "kind": "result",
                "peers": args.peers,
                "grid": f"{args.grid}x{args.grid}" if args.grid else "default",
                "group_size": args.group_size or args.grid or 32,
                "fail": args.fail,
                "gap": args.gap,
                "seed": seed,
                "numel": args.numel,
                "tolerance": args.tolerance,
                "rounds_to_tolerance": reached,
                # the paper's metric, as sim_rounds.py counts it (the cap when not reached)
                "rounds_to_variance_1e-9": next(
                    (h["round"] for h in sim.history if h["paper_variance"] < VARIANCE_TARGET),
                    None,
                ),
                "factors": [float(f"{h['factor']:.3g}") for h in sim.history],
                "rules_factors": [float(f"{h['rules_factor']:.3g}") for h in sim.history],
                "formed_factors": [float(f"{h['formed_factor']:.3g}") for h in sim.history],
                "errors": [h["error"] for h in sim.history],
                "consensus_errors": [h["consensus_error"] for h in sim.history],
                "rounds_to_consensus": next(
                    (h["round"] for h in sim.history if h["consensus_error"] <= args.tolerance),
                    None,
                ),
                "drift": sim.history[-1]["drift"] if sim.history else 0.0,
                "setup_wall_s": round(setup_wall, 2),
                "setup_virtual_s": round(setup_virtual, 2),
                "wall_s": round(total_wall, 2),
                "wall_s_per_peer": round(total_wall / args.peers, 4),
                "setup_cpu_s": round(setup_cpu, 2),
                "cpu_s": round(total_cpu, 2),
                "cpu_s_per_peer": round(total_cpu / args.peers, 4),
                "peak_rss_mb": round(peak_rss_bytes() / 2**20, 1),
                "peak_rss_mb_per_peer": round(peak_rss_bytes() / 2**20 / args.peers, 3),
            }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--peers", type=int, default=256)
    p.add_argument("--grid", type=int, default=None, help="side of a d=2 grid (default: none)")
    p.add_argument(
        "--group-size", type=int, default=None,
        help="target_group_size (default: the grid's side, or the averager's 32)",
    )  # fmt: skip
    p.add_argument("--fail", type=float, default=0.01, help="per peer per round")
    p.add_argument("--fail-window", type=float, default=5.0, help="s of a round failures hit")
    p.add_argument("--gap", type=float, default=0.0, help="virtual s between rounds")
    p.add_argument("--numel", type=int, default=4096, help="float32 elements per peer")
    p.add_argument("--tolerance", type=float, default=1e-6)
    p.add_argument("--max-rounds", type=int, default=20)
    p.add_argument("--keep-going", action="store_true", help="run all max-rounds")
    p.add_argument(
        "--until-variance", action="store_true",
        help="stop at the paper's variance < 1e-9, even if the max error is above tolerance",
    )  # fmt: skip
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--profile", type=str, default=None, help="pyinstrument HTML/text to this")
    args = p.parse_args(argv)
    for seed in args.seeds:
        if args.profile:
            from pyinstrument import Profiler

            prof = Profiler(interval=0.01, async_mode="disabled")
            prof.start()
        clock = trio.testing.MockClock(autojump_threshold=0)
        try:
            result = trio.run(run_one, args, seed, clock=clock)
        finally:  # also on Ctrl-C (timeout -s INT): the profile of a run cut short
            if args.profile:
                prof.stop()
                Path(args.profile).write_text(prof.output_text(unicode=False, show_all=False))
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
