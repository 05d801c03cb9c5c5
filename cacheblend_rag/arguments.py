"""Command-line value parsers shared by the CLI and the server's command (neither imports the other for them)."""

from __future__ import annotations

import argparse
import re

MAX_SIZE = 2**63  # bytes: larger is a typing mistake
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from '512MiB', '2GiB', '1.5G', '300MB' or '0' (K/M/G/T alone are binary, KB/MB/... decimal)."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 512MiB, 2GiB or 0")
    number, unit, binary, byte = m.groups()
    value = float(number)
    if unit:
        base = 1024 if (binary or not byte) else 1000
        value *= base ** ("kmgt".index(unit.lower()) + 1)
    if not value <= MAX_SIZE:  # 400 digits read as a float are infinity, which int() cannot take
        raise argparse.ArgumentTypeError(f"{text!r} is larger than any size this takes (at most 2^63 bytes)")
    return int(value)


def positive_int(text: str) -> int:
    """A whole number ≥ 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
