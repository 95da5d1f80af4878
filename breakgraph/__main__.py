"""Command line: ``python -m breakgraph demo [--batch N --seq N --iters N --plot PATH]``."""

import sys


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] != "demo":
        print("usage: python -m breakgraph demo [--batch N] [--seq N] [--iters N] [--plot PATH]")
        return 2
    from breakgraph.demo import main as demo

    return demo(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
