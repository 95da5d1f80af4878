"""Command lines (the demo's and the benchmarks'): what they check before any work starts.

A run that can only fail at its end, writing a plot or its results, or that
stops at a misspelt option with argparse's bare "unrecognized arguments",
costs the user a whole run or a guess; these checks answer at once.
"""

from __future__ import annotations

import argparse
import difflib
import os
import tempfile
from pathlib import Path


def write_problem(folder: Path) -> str | None:
    """Why files cannot be written in ``folder`` (made first where it is missing), or None: asked
    when the command line is read, so that a run does not end in a write that fails."""
    existing = folder
    while not os.path.exists(existing):  # "/" and "." exist: the walk ends
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a folder" if existing == folder else f"{folder} cannot be made: {existing} is a file"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        if existing == folder:
            return f"{folder} is not writable ({error.strerror})"
        return f"{folder} does not exist and cannot be made in {existing} ({error.strerror})"
    return None


def refuse_unknown_arguments(parser: argparse.ArgumentParser, unknown: list[str]) -> None:
    """Leave with argparse's status 2, naming the option each unknown one most likely meant:
    argparse's own error names what it did not take, not what to write instead."""
    known = [option for action in parser._actions for option in action.option_strings if option.startswith("--")]
    misspelt = [argument.split("=", 1)[0] for argument in unknown if argument.startswith("-")]
    guesses = {name: difflib.get_close_matches(name, known, n=1) for name in misspelt}
    if guesses and all(guesses.values()):
        meant = [match[0] if len(guesses) == 1 else f"{match[0]} for {name}" for name, match in guesses.items()]
        hint = f"did you mean {', '.join(meant)}?"
    else:
        hint = f"the options are {', '.join(known)}"
    parser.error(f"unrecognized arguments: {' '.join(unknown)}; {hint}")
