"""A runner's capture progress bar (tqdm's), or nothing where it is not shown."""

from __future__ import annotations

import contextlib


class Progress:
    """``advance()`` after each graph captured: a tqdm bar's step, or nothing."""

    def __init__(self, bar):
        self.bar = bar

    def __call__(self) -> None:
        if self.bar is not None:
            self.bar.update()

    def restart(self) -> None:
        """Back to zero, for captures made again one at a time."""
        if self.bar is not None and self.bar.n:
            self.bar.reset()


@contextlib.contextmanager
def progress_bar(total: int, shown: bool):
    """A progress bar of ``total`` captures (where ``shown``), closed on the way out."""
    if not shown:
        yield Progress(None)
        return
    from tqdm import tqdm

    with tqdm(total=total, desc="breakgraph: capturing", unit="graph") as bar:
        yield Progress(bar)
