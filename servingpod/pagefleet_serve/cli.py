"""The `pagefleet` command. Each subcommand lives in its own module and registers itself
with `add_parser(commands)`, setting `handler`."""

import argparse
import sys

from pagefleet_serve.server import serve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagefleet", description="PageFleet LLM serving.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
