"""Command line: ``python -m breakgraph demo [options]``; ``python -m breakgraph --help``."""

from __future__ import annotations

import argparse
import sys

COMMANDS = {"demo": "capture a small transformer whose attention is an eager break, check it against eager, time it"}


def version_line() -> str:
    """breakgraph's version and those of what it drives, for bug reports."""
    from importlib.metadata import PackageNotFoundError, version

    import breakgraph

    try:
        bindings = version("cuda-bindings")
    except PackageNotFoundError:
        bindings = "not installed"
    import torch

    return f"breakgraph {breakgraph.__version__} (torch {torch.__version__}, cuda-bindings {bindings})"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="python -m breakgraph",
        description="breakgraph: breakable CUDA graphs for PyTorch.",
        epilog="Run 'python -m breakgraph demo --help' for the demo's options.",
    )
    parser.add_argument("--version", action="version", version=version_line(), help="print the versions and exit")
    commands = parser.add_subparsers(dest="command", metavar="command", title="commands")
    from breakgraph import demo

    demo.add_arguments(commands.add_parser("demo", help=COMMANDS["demo"], description=COMMANDS["demo"]))
    if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS:
        parser.print_usage(sys.stderr)
        print(f"python -m breakgraph: unknown command {argv[0]!r}; the commands are: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return demo.run(args)


if __name__ == "__main__":
    sys.exit(main())
