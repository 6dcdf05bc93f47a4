"""Prometheus metrics of this process's peers: ``moshpit.serve_metrics(9100)``.

Optional: it needs ``prometheus_client`` (``pip install 'moshpit-train[metrics]'``), which
nothing imports unless metrics are turned on. Turning them on does two things:

- **scrape-time reading.** A custom collector reads, when ``/metrics`` is fetched, what the
  code already keeps: every open ``DHTNode`` (records stored, RPCs served, routing table,
  connections of its Host), every ``moshpit.Optimizer`` (steps, samples, samples/s, the
  swarm's view from its ``ProgressTracker``) and every ``TrainingStateAverager`` (epoch,
  checkpoint age and failures). Nothing runs between scrapes.
- **event observers.** What only exists as it happens is counted then, through the small
  observer lists of ``moshpit.averaging.averager`` (a finished step and its
  ``StepResult``: outcome, durations, group size, bytes; a peer banned),
  ``moshpit.training.state_averager`` (a state download) and
  ``moshpit.training.preemption`` (a SIGTERM). With metrics off those lists are empty and
  cost one check per round.

Every metric lives in one ``CollectorRegistry`` of our own (not prometheus_client's global
default): a process that also exports its own metrics (or imports another library that
registers into the default registry) cannot collide with ours, ``/metrics`` shows exactly
what docs/metrics.md lists plus the standard ``process_*`` and ``python_info`` series, and
tests can serve it more than once in one process. Labels take values from fixed, small sets
(outcome, codec class, RPC type, connection kind, signal name): never a PeerID, key or
address. Several peers in one process (tests, benchmarks) are summed; ``moshpit_epoch`` is
the largest epoch among them.

The dht layer never imports torch nor moshpit, and moshpit's lower layers never import this
module: it reads them (``sys.modules``), they do not call it.
"""

from __future__ import annotations

import http.server
import logging
import math
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "INSTALL_HINT",
    "MetricsServer",
    "MetricsUnavailableError",
    "disable",
    "enable",
    "registry",
    "serve_metrics",
]

INSTALL_HINT = "pip install 'moshpit-train[metrics]'  (or: pip install prometheus_client)"

# bounded label values
ROUND_OUTCOMES = ("succeeded", "partial", "failed", "no_group", "skipped")
DOWNLOAD_OUTCOMES = ("succeeded", "no_donor", "mismatch", "failed", "timeout", "error")
RPC_TYPES = ("ping", "store", "find")
CONNECTION_KINDS = ("direct", "relayed")
MAX_CODEC_LABELS = 16  # codec classes beyond this many distinct ones count as "other"

MATCHMAKING_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)
ALLREDUCE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
GROUP_SIZE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
DOWNLOAD_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

# modules whose observer lists we join; the first two import torch, so they are joined only
# once something else loaded them (``moshpit dht --metrics-port`` must stay torch-free)
_OBSERVED_MODULES = (
    "moshpit.averaging.averager",
    "moshpit.training.state_averager",
    "moshpit.training.preemption",
)

_TRAINING_MODULES = ("moshpit.training.optimizer", "moshpit.training.state_averager")


class MetricsUnavailableError(ImportError):
    """Metrics were asked for, but ``prometheus_client`` is not installed."""


def _prometheus() -> Any:
    try:
        import prometheus_client
        import prometheus_client.core
        import prometheus_client.exposition
    except ImportError as e:
        raise MetricsUnavailableError(
            f"Prometheus metrics need the prometheus_client package: {INSTALL_HINT}"
        ) from e
    return prometheus_client


# ---------------------------------------------------------------------------------------------
# the process's metrics


class _Metrics:
    """One registry, the event-driven series, and the scrape-time collector."""

    def __init__(self, prom: Any) -> None:
        self.prom = prom
        reg = self.registry = prom.CollectorRegistry(auto_describe=True)
        self._lock = threading.Lock()
        self.enabled = False
        self._joined: set[str] = set()
        self._codec_labels: set[str] = set()
        self._declare_averaging(prom, reg)
        self._declare_state(prom, reg)
        # every bounded label value exists from the start, at 0
        for outcome in ROUND_OUTCOMES:
            self.rounds.labels(outcome)
        for outcome in DOWNLOAD_OUTCOMES:
            self.downloads.labels(outcome)
        for name in ("SIGTERM", "SIGINT"):
            self.preemptions.labels(name)
        self._sent_by_codec: dict[str, Any] = {}
        self._received_by_codec: dict[str, Any] = {}
        reg.register(_Collector(self))
        prom.ProcessCollector(registry=reg)
        prom.PlatformCollector(registry=reg)

    def _declare_averaging(self, prom: Any, reg: Any) -> None:
        """The series of averaging steps (``on_averager``)."""
        self.rounds = prom.Counter(
            "moshpit_averaging_rounds",
            "Averaging steps by outcome: succeeded (averaged with every member), partial "
            "(averaged, some member failed), failed (a group formed, nothing averaged), "
            "no_group (matchmaking found no group), skipped (sat out, cancelled, lock timeout)",
            ["outcome"],
            registry=reg,
        )
        self.matchmaking = prom.Histogram(
            "moshpit_averaging_matchmaking_seconds",
            "Time a step spent looking for a group (steps that looked)",
            buckets=MATCHMAKING_BUCKETS,
            registry=reg,
        )
        self.allreduce = prom.Histogram(
            "moshpit_averaging_allreduce_seconds",
            "Time a step's all-reduce took (steps whose group formed)",
            buckets=ALLREDUCE_BUCKETS,
            registry=reg,
        )
        self.group_size = prom.Histogram(
            "moshpit_averaging_group_size",
            "Members of the group each step formed, this peer included",
            buckets=GROUP_SIZE_BUCKETS,
            registry=reg,
        )
        self.sent = prom.Counter(
            "moshpit_averaging_sent_bytes",
            "Tensor payload bytes this peer sent in all-reduces, by codec (framing excluded)",
            ["codec"],
            registry=reg,
        )
        self.received = prom.Counter(
            "moshpit_averaging_received_bytes",
            "Tensor payload bytes this peer received in all-reduces, by codec",
            ["codec"],
            registry=reg,
        )
        self.excluded = prom.Counter(
            "moshpit_averaging_excluded_peers",
            "Group members a reducer left out of a part (stalled, bad values, other schema)",
            registry=reg,
        )
        self.failed_peers = prom.Counter(
            "moshpit_averaging_failed_peers",
            "Group members that failed a round with this peer",
            registry=reg,
        )
        self.banned = prom.Counter(
            "moshpit_averaging_banned_peers",
            "Peers this peer stopped grouping with for a while after repeated failures",
            registry=reg,
        )

    def _declare_state(self, prom: Any, reg: Any) -> None:
        """The series of state downloads (``on_state``) and preemptions (``on_preemption``)."""
        self.downloads = prom.Counter(
            "moshpit_state_downloads",
            "Attempts to load the swarm's state from donors, by outcome",
            ["outcome"],
            registry=reg,
        )
        self.download_seconds = prom.Histogram(
            "moshpit_state_download_seconds",
            "Time each attempt to load the swarm's state took",
            buckets=DOWNLOAD_BUCKETS,
            registry=reg,
        )
        self.download_bytes = prom.Counter(
            "moshpit_state_download_bytes",
            "Bytes of state received from donors in successful downloads",
            registry=reg,
        )
        self.preemptions = prom.Counter(
            "moshpit_preemptions",
            "Signals (a preemption notice) that made this process leave the swarm",
            ["signal"],
            registry=reg,
        )

    # -- observers (called on the thread of the event) --------------------------------------

    def on_averager(self, event: str, averager: Any, detail: Any) -> None:
        if event == "ban":
            self.banned.inc()
            return
        if event != "step":
            return
        r = detail
        self.rounds.labels(_round_outcome(r)).inc()
        formed = r.group_id is not None
        if formed or r.matchmaking_seconds > 0:
            self.matchmaking.observe(r.matchmaking_seconds)
        if formed:
            self.group_size.observe(len(r.members))
            if r.allreduce_seconds > 0:
                self.allreduce.observe(r.allreduce_seconds)
        if r.bytes_sent or r.bytes_received:
            codec = self._codec_label(getattr(averager, "compression", None))
            sent = self._sent_by_codec.get(codec)
            if sent is None:
                sent = self._sent_by_codec[codec] = self.sent.labels(codec)
                self._received_by_codec[codec] = self.received.labels(codec)
            if r.bytes_sent:
                sent.inc(r.bytes_sent)
            if r.bytes_received:
                self._received_by_codec[codec].inc(r.bytes_received)
        if r.excluded:
            self.excluded.inc(len(r.excluded))
        if r.failed:
            self.failed_peers.inc(len(r.failed))

    def on_state(self, event: str, _state: Any, detail: Any) -> None:
        if event != "download":
            return
        error, seconds, result = detail
        self.downloads.labels(_download_outcome(error)).inc()
        self.download_seconds.observe(max(0.0, seconds))
        if result is not None:
            received = sum(getattr(result, "bytes_by_peer", {}).values())
            if received:
                self.download_bytes.inc(received)

    def on_preemption(self, event: str, _handler: Any, name: Any) -> None:
        if event == "signal":
            label = name if name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT") else "other"
            self.preemptions.labels(label).inc()

    def _codec_label(self, compression: Any) -> str:
        label = _codec_name(compression)
        if label not in self._codec_labels:
            with self._lock:
                if len(self._codec_labels) >= MAX_CODEC_LABELS:
                    return "other"  # bounded, whatever codecs a program makes up
                self._codec_labels.add(label)
        return label

    # -- joining the lower layers' observer lists ------------------------------------------

    def join_observers(self) -> None:
        """Join the observer lists of the observed modules that are loaded (idempotent)."""
        if not self.enabled:
            return
        if "torch" in sys.modules:  # loading these costs nothing new then
            for name in _OBSERVED_MODULES[:2]:
                if name not in sys.modules:
                    __import__(name)
        if _OBSERVED_MODULES[2] not in sys.modules:
            __import__(_OBSERVED_MODULES[2])  # torch-free
        handlers = (self.on_averager, self.on_state, self.on_preemption)
        for name, handler in zip(_OBSERVED_MODULES, handlers, strict=True):
            module = sys.modules.get(name)
            if module is None or name in self._joined:
                continue
            with self._lock:
                if name not in self._joined:
                    module.observers.append(handler)
                    self._joined.add(name)

    def leave_observers(self) -> None:
        handlers = (self.on_averager, self.on_state, self.on_preemption)
        with self._lock:
            for name, handler in zip(_OBSERVED_MODULES, handlers, strict=True):
                module = sys.modules.get(name)
                if module is not None and handler in module.observers:
                    module.observers.remove(handler)
                self._joined.discard(name)


def _round_outcome(r: Any) -> str:
    if r.succeeded:
        return "partial" if r.failed else "succeeded"
    if r.group_id is not None:
        return "failed"
    if r.matchmaking_seconds > 0:
        return "no_group"
    return "skipped"


def _download_outcome(error: BaseException | None) -> str:
    if error is None:
        return "succeeded"
    from moshpit.training.errors import NoDonorError, StateDownloadError, StateMismatchError

    if isinstance(error, NoDonorError):
        return "no_donor"
    if isinstance(error, StateMismatchError):
        return "mismatch"
    if isinstance(error, StateDownloadError):
        return "failed"
    if isinstance(error, TimeoutError):
        return "timeout"
    return "error"


def _codec_name(compression: Any) -> str:
    """A codec's class name (both directions' for a two-way one), "none" for none."""
    if compression is None:
        return "none"
    if isinstance(compression, str):
        return compression.lower()[:32] or "none"
    sender = getattr(getattr(compression, "sender", None), "codec", None)
    reducer = getattr(getattr(compression, "reducer", None), "codec", None)
    if sender is not None and reducer is not None:
        return f"{type(sender).__name__}/{type(reducer).__name__}"
    return type(compression).__name__


# ---------------------------------------------------------------------------------------------
# scrape time


def _live(module_name: str, attribute: str) -> list[Any]:
    """A snapshot of a module's weak set of live objects ([] if the module is not loaded)."""
    module = sys.modules.get(module_name)
    objects = getattr(module, attribute, None)
    if objects is None:
        return []
    for _ in range(10):  # the set may change under us (another thread adds an object)
        try:
            return list(objects)
        except RuntimeError:
            continue
    return []


class _Totals:
    """A counter summed over live objects that never goes down when one of them goes away:
    the last values read from it are kept (what it counted after that scrape is lost)."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[weakref.ref[Any], dict[str, float]]] = {}
        self._gone: dict[str, float] = {}

    def total(
        self, objects: Iterable[Any], read: Callable[[Any], dict[str, float]]
    ) -> dict[str, float]:
        objects = list(objects)
        current = {id(obj): obj for obj in objects}
        for key, (ref, values) in list(self._last.items()):
            if current.get(key) is not ref():  # closed, collected, or its id reused
                for name, value in values.items():
                    self._gone[name] = self._gone.get(name, 0.0) + value
                del self._last[key]
        totals = dict(self._gone)
        for obj in objects:
            try:
                values = read(obj)
            except Exception:  # noqa: BLE001 - one odd object must not break the scrape
                logger.debug("could not read %r", obj, exc_info=True)
                continue
            self._last[id(obj)] = (weakref.ref(obj), values)
            for name, value in values.items():
                totals[name] = totals.get(name, 0.0) + value
        return totals


class _Collector:
    """Reads the live DHT nodes, optimizers and training states when scraped."""

    def __init__(self, metrics: _Metrics) -> None:
        self.metrics = metrics
        self._lock = threading.Lock()  # two scrapes at once share the _Totals
        self._served = _Totals()
        self._republished = _Totals()
        self._steps = _Totals()
        self._state_counts = _Totals()

    def describe(self) -> list[Any]:
        return []  # unchecked: the families depend on what runs in the process

    def collect(self) -> Iterator[Any]:
        self.metrics.join_observers()  # modules loaded since the last scrape
        with self._lock:
            families = list(self._families())
        yield from families

    def _families(self) -> Iterator[Any]:
        core = self.metrics.prom.core
        from moshpit import __version__

        info = core.GaugeMetricFamily(
            "moshpit_info", "moshpit version of this process", labels=["version"]
        )
        info.add_metric([__version__], 1)
        yield info
        yield from self._dht(core)
        yield from self._training(core)

    def _dht(self, core: Any) -> Iterator[Any]:
        nodes = _live("dht.kademlia.node", "open_nodes")
        yield core.GaugeMetricFamily(
            "moshpit_dht_nodes", "Open DHT nodes in this process", value=len(nodes)
        )
        records = stored = routing = 0
        connections = dict.fromkeys(CONNECTION_KINDS, 0)
        hosts: set[int] = set()
        for node in nodes:
            storage = getattr(node, "storage", None)
            if storage is not None:
                records += storage.num_records
                stored += storage.num_bytes
            routing += len(node.routing_table)
            host = getattr(node, "host", None)
            if host is not None and id(host) not in hosts and hasattr(host, "connection_counts"):
                hosts.add(id(host))
                for kind, count in host.connection_counts().items():
                    if kind in connections:
                        connections[kind] += count
        yield core.GaugeMetricFamily(
            "moshpit_dht_records_stored",
            "Records this peer stores for the DHT (its own and other peers')",
            value=records,
        )
        yield core.GaugeMetricFamily(
            "moshpit_dht_stored_bytes", "Bytes of the records this peer stores", value=stored
        )
        yield core.GaugeMetricFamily(
            "moshpit_dht_routing_table_peers", "Contacts in the routing table", value=routing
        )
        served = self._served.total(
            nodes, lambda n: {k: float(v) for k, v in dict(n.requests_served).items()}
        )
        family = core.CounterMetricFamily(
            "moshpit_dht_requests_served", "DHT RPCs this peer answered, by type", labels=["rpc"]
        )
        for rpc in RPC_TYPES:
            family.add_metric([rpc], served.get(rpc, 0.0))
        yield family
        republished = self._republished.total(
            nodes, lambda n: {"records": float(n.maintenance.republished_records)}
        )
        yield core.CounterMetricFamily(
            "moshpit_dht_republished_records",
            "Own records republished before they expired",
            value=republished.get("records", 0.0),
        )
        family = core.GaugeMetricFamily(
            "moshpit_connections", "Open libp2p connections, by kind", labels=["kind"]
        )
        for kind in CONNECTION_KINDS:
            family.add_metric([kind], connections[kind])
        yield family

    def _training(self, core: Any) -> Iterator[Any]:
        if not any(name in sys.modules for name in _TRAINING_MODULES):
            return  # e.g. `moshpit dht`: no training series at all
        optimizers = [
            o
            for o in _live("moshpit.training.optimizer", "live_optimizers")
            if not getattr(o, "_closed", False)
        ]
        states = [
            s
            for s in _live("moshpit.training.state_averager", "live_state_averagers")
            if not getattr(s, "_closed", False)
        ]
        yield from self._steps_and_checkpoints(core, optimizers, states)
        if states:
            yield core.GaugeMetricFamily(
                "moshpit_epoch",
                "The training epoch (global step) this peer is at",
                value=max(s.epoch for s in states),
            )
        if optimizers:
            yield from _throughput(core, optimizers)
        now = time.monotonic()
        written = [s.last_checkpoint_at for s in states if s.last_checkpoint_at is not None]
        if written:
            yield core.GaugeMetricFamily(
                "moshpit_checkpoint_age_seconds",
                "Seconds since this peer last wrote a checkpoint successfully",
                value=max(0.0, now - max(written)),
            )

    def _steps_and_checkpoints(
        self, core: Any, optimizers: list[Any], states: list[Any]
    ) -> Iterator[Any]:
        """The counters summed over optimizers (steps, samples) and training states
        (checkpoint failures, recoveries)."""
        steps = self._steps.total(
            optimizers,
            lambda o: {
                "steps": float(o.local_steps),
                "samples": float(o.samples_processed),
                "skipped": float(o.skipped_steps),
            },
        )
        for name, key, text in (
            ("moshpit_local_steps", "steps", "Optimizer steps whose batch went into training"),
            ("moshpit_samples_processed", "samples", "Samples those steps trained on"),
            ("moshpit_skipped_steps", "skipped", "Steps dropped for non-finite gradients"),
        ):
            yield core.CounterMetricFamily(name, text, value=steps.get(key, 0.0))
        counts = self._state_counts.total(
            states,
            lambda s: {
                "failures": float(s.checkpoint_failures),
                "recoveries": float(s.recoveries),
            },
        )
        yield core.CounterMetricFamily(
            "moshpit_checkpoint_failures",
            "Background checkpoints that failed (disk full, read-only, non-finite state)",
            value=counts.get("failures", 0.0),
        )
        yield core.CounterMetricFamily(
            "moshpit_state_recoveries",
            "Times a non-finite state was replaced by a good one",
            value=counts.get("recoveries", 0.0),
        )


def _throughput(core: Any, optimizers: list[Any]) -> Iterator[Any]:
    """This peer's samples/s, and the swarm as its newest progress view shows it."""
    rate, views = 0.0, []
    for optimizer in optimizers:
        try:
            tracker = optimizer.tracker
            sps = float(tracker.samples_per_second)
            views.append(tracker.global_progress)
        except Exception:  # noqa: BLE001 - a tracker shutting down
            continue
        rate += sps if math.isfinite(sps) else 0.0
    yield core.GaugeMetricFamily(
        "moshpit_samples_per_second",
        "This peer's training throughput (moving average over recent steps)",
        value=rate,
    )
    if not views:
        return
    view = max(views, key=lambda v: getattr(v, "time", 0.0))
    for name, attribute, text in (
        ("moshpit_swarm_peers", "num_peers", "Peers of the run this peer sees"),
        ("moshpit_swarm_epoch", "epoch", "The run's epoch as this peer sees it"),
        (
            "moshpit_swarm_samples_per_second",
            "samples_per_second",
            "The run's throughput as this peer sees it",
        ),
    ):
        yield core.GaugeMetricFamily(name, text, value=float(getattr(view, attribute, 0) or 0))


# ---------------------------------------------------------------------------------------------
# turning metrics on and off

_metrics: _Metrics | None = None
_metrics_lock = threading.Lock()


def enable() -> Any:
    """Turn metrics on in this process (idempotent); returns the ``CollectorRegistry``.

    Raises :class:`MetricsUnavailableError` without ``prometheus_client``. Counters keep
    counting across :func:`disable` / :func:`enable`.
    """
    global _metrics
    prom = _prometheus()
    with _metrics_lock:
        if _metrics is None:
            _metrics = _Metrics(prom)
        _metrics.enabled = True
    _metrics.join_observers()
    return _metrics.registry


def disable() -> None:
    """Stop counting events (the observers leave; servers still answer with what is read
    at scrape time). Mostly for benchmarks: with metrics off the hooks cost nothing."""
    with _metrics_lock:
        if _metrics is None:
            return
        _metrics.enabled = False
        _metrics.leave_observers()


def registry() -> Any:
    """The process's ``CollectorRegistry`` (turns metrics on)."""
    return enable()


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _HTTPServer

    def do_GET(self) -> None:  # noqa: N802 - the http.server API
        path = self.path.split("?", 1)[0]
        if path not in ("/metrics", "/"):
            self.send_error(404, "only /metrics is served here")
            return
        from prometheus_client.exposition import choose_encoder

        encoder, content_type = choose_encoder(self.headers.get("Accept") or "")
        try:
            body = encoder(self.server.registry)
        except Exception as e:  # noqa: BLE001 - answer the scraper, keep serving
            logger.exception("collecting metrics failed")
            self.send_error(500, f"collecting metrics failed: {type(e).__name__}")
            return
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server API
        logger.debug("metrics: " + format, *args)


class _HTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    registry: Any = None


class MetricsServer:
    """A running ``/metrics`` endpoint (see :func:`serve_metrics`); ``close()`` stops it."""

    def __init__(self, httpd: _HTTPServer, thread: threading.Thread) -> None:
        self._httpd = httpd
        self._thread = thread
        host, port = httpd.server_address[:2]
        self.addr: str = host if isinstance(host, str) else bytes(host).decode()
        self.port: int = port

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving (idempotent). Metrics stay on: counters keep counting."""
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join(timeout=5)
        self._httpd.server_close()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MetricsServer({self.url})"


def serve_metrics(port: int, addr: str = "127.0.0.1") -> MetricsServer:
    """Serve this process's Prometheus metrics at ``http://addr:port/metrics`` (a thread).

    Binds to 127.0.0.1 unless ``addr`` says otherwise (e.g. ``"0.0.0.0"`` for a Prometheus
    on another machine: the metrics say how this peer trains, nothing secret, but a port
    open to the internet is better left to a deliberate choice). ``port=0`` picks a free
    port (``.port`` says which). Returns a :class:`MetricsServer`.

    Raises :class:`MetricsUnavailableError` (an ImportError) when ``prometheus_client`` is
    not installed (``pip install 'moshpit-train[metrics]'``), ``ValueError`` for a bad port
    and ``OSError`` when the address cannot be bound (e.g. the port is taken).
    See docs/metrics.md for what is exported.
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an int in 0..65535, got {port!r}")
    reg = enable()
    server_class = _HTTPServer
    if ":" in addr:

        class _HTTPServer6(_HTTPServer):
            address_family = socket.AF_INET6

        server_class = _HTTPServer6
    httpd = server_class((addr, port), _Handler)
    httpd.registry = reg
    thread = threading.Thread(
        target=httpd.serve_forever, kwargs={"poll_interval": 0.5}, name="moshpit-metrics"
    )
    thread.daemon = True
    thread.start()
    server = MetricsServer(httpd, thread)
    logger.info("serving Prometheus metrics at %s", server.url)
    return server
