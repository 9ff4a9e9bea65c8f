"""Bad input refused, none silently wrong: the table of issue 34's cases.

    python benchmarks/bad_inputs.py

Each case of ``tests/unit/test_refusals.py`` (counts of 0 or below for the recipes' parameters, from
Python, Hydra and ``NnScalerStrategy``; a collective timeout of 0 or below; batches with fewer rows
than the data-parallel replicas or the microbatches they are split into) is run once: ``refused``
when it raises the expected error with the expected message, ``OTHER`` when it raises something else
(the line shows it), ``SILENT`` when it runs. Goal: 0 silent, 0 other.
"""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "unit"))

import test_refusals as refusals  # noqa: E402 - the cases, shared with the tests


def bad_input_table() -> tuple[int, int, int]:
    """Print each case's outcome; returns (tried, refused, silent)."""
    refused = silent = 0
    print(f"{'case':<56} outcome")
    for name, (run, kind, pattern) in refusals.CASES.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                run()
        except kind as error:
            matched = re.search(pattern, str(error)) is not None
            refused += matched
            outcome = "refused" if matched else f"OTHER: {type(error).__name__}: {error}"
        except Exception as error:  # noqa: BLE001 - the table shows whatever it was
            outcome = f"OTHER: {type(error).__name__}: {error}"
        else:
            silent += 1
            outcome = "SILENT"
        print(f"{name:<56} {outcome}")
    return len(refusals.CASES), refused, silent


def main() -> None:
    tried, refused, silent = bad_input_table()
    print(f"\n{tried} cases: {refused} refused with the expected message, {silent} silent, {tried - refused - silent} other")
    if refused != tried:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
