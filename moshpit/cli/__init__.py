"""The ``moshpit`` console script: one subcommand per module, imported only when used."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# subcommand -> (module, one-line help). Each module defines
# ``configure_parser(parser: argparse.ArgumentParser) -> None`` and ``run(args) -> int``.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "dht": ("moshpit.cli.dht_cmd", "run a DHT peer (bootstrap/relay node); needs no torch"),
    "demo": ("moshpit.cli.demo_cmd", "start a local swarm and watch Moshpit averaging converge"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moshpit", description=__doc__)
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if a in SUBCOMMANDS), None)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text)
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


if __name__ == "__main__":
    sys.exit(main())
