"""Command line: ``python3 -m breakgraph demo [options]``; ``python3 -m breakgraph --help``."""

from __future__ import annotations

import argparse
import sys

COMMANDS = {"demo": "capture a small transformer whose attention is an eager break, check it against eager, time it"}


def gpu_line() -> str:
    """Which GPU torch sees, if any: a bug report's first question, answered without failing where there is none."""
    import torch

    if torch.version.cuda is None:
        return f"no CUDA GPU visible (torch {torch.__version__} is built without CUDA)"
    try:
        count = torch.cuda.device_count()
        name = torch.cuda.get_device_name(0) if count else None
    except RuntimeError as error:  # a driver torch cannot use
        return f"no CUDA GPU usable ({str(error).splitlines()[0]})"
    if name is None:
        return "no CUDA GPU visible"
    return f"GPU: {name}" + (f" (device 0 of {count})" if count > 1 else "")


def version_line() -> str:
    """breakgraph's version, those of what it drives and the GPU it sees, for bug reports."""
    from importlib.metadata import PackageNotFoundError, version

    import breakgraph

    try:
        bindings = version("cuda-bindings")
    except PackageNotFoundError:
        bindings = "not installed"
    import torch

    return f"breakgraph {breakgraph.__version__} (torch {torch.__version__}, cuda-bindings {bindings}); {gpu_line()}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="python3 -m breakgraph",
        description="breakgraph: breakable CUDA graphs for PyTorch.",
        epilog="Run 'python3 -m breakgraph demo --help' for the demo's options.",
    )
    # not argparse's version action: that would ask for the GPU on every run, not only on --version
    parser.add_argument("--version", action="store_true", help="print the versions and the GPU seen, and exit")
    commands = parser.add_subparsers(dest="command", metavar="command", title="commands")
    from breakgraph import demo
    from breakgraph.base.command_line import refuse_unknown_arguments

    demo_parser = commands.add_parser("demo", help=COMMANDS["demo"], description=COMMANDS["demo"])
    demo.add_arguments(demo_parser)
    if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS:
        parser.print_usage(sys.stderr)
        print(f"python3 -m breakgraph: unknown command {argv[0]!r}; the commands are: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        refuse_unknown_arguments(demo_parser if args.command == "demo" else parser, unknown)
    if args.version:
        print(version_line())
        return 0
    if args.command is None:
        parser.print_help()
        return 2
    return demo.run(args)


if __name__ == "__main__":
    sys.exit(main())
