"""What a run shows while it works and says at its end: tqdm's bar (inputs/s, patches/s, ETA) and where the time
went (:class:`Timings`)."""

from __future__ import annotations

import dataclasses
import sys

__all__ = ["Progress", "Timings", "plural"]


def plural(count: int, noun: str) -> str:
    """``"1 image"``, ``"2 images"``."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


class Progress:
    """tqdm's bar over ``total`` inputs on ``stream`` (default stderr) with inputs/s, patches/s and the ETA, drawn
    only on a terminal so that logs get no carriage returns."""

    def __init__(self, total: int, stream=None, enabled: bool = True):
        from tqdm import tqdm

        stream = sys.stderr if stream is None else stream
        self.patches = 0
        # Drawn before the first batch, which can be slow (worker start, compilation, warm-up).
        self.bar = tqdm(total=total, desc="qvl: encode", unit="input", file=stream,
                        disable=not (enabled and stream.isatty()), dynamic_ncols=True)  # fmt: skip

    def update(self, inputs: int, patches: int) -> None:
        """Count ``inputs`` more inputs of ``patches`` patches in all as done."""
        self.patches += patches
        elapsed = self.bar.format_dict["elapsed"]
        self.bar.set_postfix_str(f"{self.patches / elapsed if elapsed > 0 else 0.0:.0f} patches/s", refresh=False)
        self.bar.update(inputs)

    def close(self) -> None:
        self.bar.close()


@dataclasses.dataclass
class Timings:
    """Seconds a run spent per stage. ``decode`` and ``prepare`` are summed where they ran (worker processes, which
    overlap the tower, or this one); ``waiting`` is this process waiting for the next input."""

    decode: float = 0.0
    prepare: float = 0.0
    tower: float = 0.0
    write: float = 0.0
    waiting: float = 0.0

    def summary(self, decoded_in: str, prepared_in: str) -> str:
        """One line of the split, saying where decoding and preparation ran (``"in 2 worker processes"``, ...)."""
        return (
            f"decoding {self.decode:.2f} s ({decoded_in}), preparation {self.prepare:.2f} s ({prepared_in}), tower"
            f" {self.tower:.2f} s, writing {self.write:.2f} s, waiting for inputs {self.waiting:.2f} s"
        )
