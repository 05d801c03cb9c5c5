"""The two fuzz profiles every `tests/test_fuzz_*.py` surface runs under, chosen by one environment variable.

- quick (the default, in every pytest run): a fixed seed (`derandomize`), a few hundred examples per surface, no
  example database written; the same examples on every machine, so a red CI is reproducible.
- long (`make fuzz DURATION=600`, which sets $CACHEBLEND_FUZZ_SECONDS): each surface (one of SURFACES: the issue's
  input surfaces) runs batch after batch of new random examples for that many seconds, split evenly among its
  property tests (the batch running then finishes: up to LONG_BATCH examples more); failing
  examples are kept in Hypothesis's database (.hypothesis/ at the
  repository root) and replayed first next time; the shrunk failing example is printed with the seed to reproduce
  it (`@reproduce_failure`).
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

from hypothesis import HealthCheck, Phase, Verbosity, settings
from hypothesis.database import DirectoryBasedExampleDatabase

ENV_SECONDS = "CACHEBLEND_FUZZ_SECONDS"
REPO = Path(__file__).resolve().parents[1]
DATABASE = REPO / ".hypothesis" / "examples"
LONG_BATCH = 500  # examples per batch of the long profile: each batch starts from a new seed
# the fuzzed surfaces are slow for Hypothesis's taste (a server round trip, a file written and read): expected
SLOW_IS_FINE = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                HealthCheck.function_scoped_fixture, HealthCheck.large_base_example]


SURFACES = ("server bodies", "server headers", "CLI", "ingest loaders", "Python API", "stored entries")
_TESTS_PER_SURFACE: dict[str, int] = dict.fromkeys(SURFACES, 0)


def fuzz_seconds() -> float | None:
    """Seconds per surface of the long profile, or None for the quick one."""
    value = os.environ.get(ENV_SECONDS, "").strip()
    return float(value) if value else None


def fuzz(quick_examples: int, surface: str):
    """Decorator over a `@given` test of `surface`: `quick_examples` seeded examples, or the long profile's batches
    for the surface's seconds divided among its tests."""
    if surface not in SURFACES:
        raise ValueError(f"surface must be one of {SURFACES}, got {surface!r}")
    _TESTS_PER_SURFACE[surface] += 1
    total = fuzz_seconds()

    def wrap(test):
        if total is None:
            return settings(max_examples=quick_examples, derandomize=True, database=None, deadline=None,
                            suppress_health_check=SLOW_IS_FINE, print_blob=False)(test)
        batch = settings(max_examples=LONG_BATCH, derandomize=False, database=DirectoryBasedExampleDatabase(DATABASE),
                         deadline=None, suppress_health_check=SLOW_IS_FINE, print_blob=True,
                         verbosity=Verbosity.normal, phases=tuple(Phase))(test)

        @functools.wraps(batch)
        def for_the_duration(*args, **kwargs):
            seconds = total / _TESTS_PER_SURFACE[surface]  # every test module is imported by now
            end = time.monotonic() + seconds
            batches = 0
            while batches == 0 or time.monotonic() < end:
                batch(*args, **kwargs)  # a failure raises with the shrunk example printed
                batches += 1
            print(f"{surface}: {test.__name__}: {batches} batch(es) of up to {LONG_BATCH} examples in {seconds:g} s "
                  f"({total:g} s for the surface), no failure")

        return for_the_duration

    return wrap
