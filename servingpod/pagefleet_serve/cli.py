"""The `pagefleet` command. Each subcommand lives in its own module and registers itself
with `add_parser(commands)`, setting `handler`."""

import argparse
import sys

from pagefleet_serve.bench import serve as bench
from pagefleet_serve.server import serve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagefleet", description="PageFleet LLM serving.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve.add_parser(commands)
    bench.add_parser(commands)
    # Listed for --help; main() hands its arguments to the operator's own parser.
    commands.add_parser("operator", help="run the Kubernetes operator (kopf)")
    commands.add_parser("router", help="route OpenAI requests to pods by prefix and load")
    return parser


def _run_operator(argv: list[str]) -> int:
    # The operator is its own package with its own flags; imported only when asked for.
    from pagefleet_operator.__main__ import main as operator_main

    return operator_main(argv)


def _run_router(argv: list[str]) -> int:
    # The router ships in the operator's torch-free image; imported only when asked for.
    from pagefleet_router.cli import main as router_main

    return router_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["operator"]:
        return _run_operator(argv[1:])
    if argv[:1] == ["router"]:
        return _run_router(argv[1:])
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
