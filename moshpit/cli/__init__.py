"""The ``moshpit`` console script: one subcommand per module, imported only when used.

Each subcommand module defines ``configure_parser(parser)`` and ``run(args) -> int``; the
user-facing text of ``moshpit --help`` is ``DESCRIPTION``/``EPILOG`` below.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import NoReturn

DESCRIPTION = """\
moshpit: train one PyTorch model together on many machines that come and go.

Peers find each other through a DHT and average their parameters in small groups
(Moshpit averaging). Start a DHT peer that others can join, then point your training
script (moshpit.DHT(initial_peers=[...])) or volunteers (moshpit train --initial-peers ...)
at the address it prints."""

EPILOG = """\
examples:
  start the first peer of a swarm (prints the --initial-peers line others copy):
    moshpit dht --host-maddrs /ip4/0.0.0.0/tcp/31337 --identity peer.key
  train with that swarm from another machine (paste the printed line):
    moshpit train --initial-peers /ip4/203.0.113.7/tcp/31337/p2p/12D3KooW...
  behind NAT / port forwarding, tell others your public address:
    moshpit dht --host-maddrs /ip4/0.0.0.0/tcp/31337 --announce-maddrs /ip4/203.0.113.7/tcp/31337
  watch 4 local peers train while some are preempted (SIGTERM / kill -9):
    moshpit demo
  a live web page of a run (http://127.0.0.1:8080/):
    moshpit dashboard --initial-peers /ip4/203.0.113.7/tcp/31337/p2p/12D3KooW... --run-id RUN

Run 'moshpit COMMAND --help' for the options of a command."""

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "dht": (
        "moshpit.cli.dht_cmd",
        "run a DHT peer that others join (bootstrap/relay node); needs no GPU or torch",
    ),
    "demo": (
        "moshpit.cli.demo_cmd",
        "a local swarm trains while peers are preempted (or: averaging)",
    ),
    "status": ("moshpit.cli.status_cmd", "show a run's peers, epochs, donors and health"),
    "dashboard": (
        "moshpit.cli.dashboard_cmd",
        "serve a live web page of a run (peers, throughput, loss, contributions)",
    ),
    "train": (
        "moshpit.cli.train_cmd",
        "run a volunteer peer: join, train, checkpoint, survive SIGTERM",
    ),
}


def version() -> str:
    """The installed distribution's version (``moshpit.__version__`` when run from a checkout)."""
    try:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version

        return dist_version("moshpit-train")
    except PackageNotFoundError:
        from moshpit import __version__

        return __version__


def wanted_command(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names (its first word that is one), if any."""
    return next((a for a in argv if a in SUBCOMMANDS), None)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moshpit",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"moshpit {version()}")
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = wanted_command(argv)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:  # import only the module that will run
            importlib.import_module(module_name).configure_parser(sub_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    level = logging.WARNING - 10 * args.verbose
    logging.basicConfig(
        level=max(level, logging.DEBUG), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    module_name, _ = SUBCOMMANDS[args.command]
    return int(importlib.import_module(module_name).run(args) or 0)


def console(argv: list[str] | None = None) -> NoReturn:
    """The ``moshpit`` console script and ``python -m moshpit``: :func:`main` in a process of
    its own: it imports the command with the garbage collector paused (``process_start.py``)
    and ends without Python's module teardown (``process_exit.py``)."""
    from moshpit.cli.process_exit import exit_without_teardown
    from moshpit.cli.process_start import import_command

    argv = sys.argv[1:] if argv is None else argv
    command = wanted_command(argv)
    if command is not None:
        import_command(SUBCOMMANDS[command][0], argv)
    exit_without_teardown(main(argv))


if __name__ == "__main__":
    console()
