"""The `pagefleet` command. Each subcommand lives in its own module, imported only when that
subcommand runs: `pagefleet operator` and `pagefleet router` must start without torch or
the serving stack (the operator's image has neither), and `pagefleet --help` imports none.

`serve` and `bench` register themselves with `add_parser(commands)`, setting `handler`;
`operator` and `router` have their own parsers and are handed their arguments whole."""

import argparse
import importlib
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Subcommand:
    module: str
    help: str
    # True: the module's main(argv) parses its own flags; False: add_parser(commands).
    owns_parser: bool = False


SUBCOMMANDS = {
    "serve": Subcommand(
        "pagefleet_serve.server.serve", "serve a model over an OpenAI-compatible HTTP API"
    ),
    "bench": Subcommand("pagefleet_bench.serve", "benchmark an OpenAI-compatible server"),
    "operator": Subcommand(
        "pagefleet_operator.__main__", "run the Kubernetes operator (kopf)", owns_parser=True
    ),
    "router": Subcommand(
        "pagefleet_router.cli",
        "route OpenAI requests to pods by prefix and load",
        owns_parser=True,
    ),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser with every subcommand listed; only `command`'s module is imported and
    given its full flags."""
    parser = argparse.ArgumentParser(prog="pagefleet", description="PageFleet LLM serving.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, sub in SUBCOMMANDS.items():
        if name == command and not sub.owns_parser:
            importlib.import_module(sub.module).add_parser(commands)
        else:
            commands.add_parser(name, help=sub.help)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv else None
    sub = SUBCOMMANDS.get(command)
    if sub is not None and sub.owns_parser:
        return importlib.import_module(sub.module).main(argv[1:])
    args = build_parser(command).parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
