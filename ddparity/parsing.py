"""Settings written as text (the CLI's flags, environment variables, pytest's ini files)
turned into values: each ``parse_*(text, where)`` returns what the matching validator of
:mod:`ddparity.settings` accepts, or raises a :class:`~ddparity.errors.UsageError` that names
``where`` and the fix.
"""

from __future__ import annotations

import math

from ddparity.errors import UsageError
from ddparity.settings import TOLERANCE_HELP, timeout_problem, tolerance_ok, validate_modes


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.replace(" ", ",").split(",") if part.strip()]


def parse_world_sizes(text: str, where: str) -> tuple[int, ...]:
    if any(not part.strip() for part in text.split(",")):
        raise UsageError(f"{where}: an empty world size in {text!r}; give integers separated by commas, e.g. 1,2,4")
    try:
        sizes = tuple(int(part) for part in _split(text))
    except ValueError:
        raise UsageError(f"{where}: {text!r} is not a comma-separated list of integers, e.g. 1,2,4") from None
    if not sizes or any(ws < 1 for ws in sizes):
        raise UsageError(f"{where}: world sizes must be integers >= 1 separated by commas, got {text!r}")
    return sizes


def parse_modes(text: str, where: str) -> tuple[str, ...]:
    return validate_modes(_split(text), where)


def parse_timeout(text: str, where: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"{where}: timeout must be a positive number of seconds, got {text!r}") from None
    problem = timeout_problem(value)
    if problem:
        raise UsageError(f"{where}: timeout {problem}, got {text!r}")
    return value


def parse_seconds(text: str, where: str) -> float:
    """A positive, finite number of seconds (``--long 30``)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value > 0 and value != float("inf")):
        raise UsageError(f"{where}: give a positive number of seconds, e.g. 30, got {text!r}")
    return value


def parse_tolerance(text: str, where: str) -> str | float:
    if text == "auto":
        return "auto"
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not tolerance_ok(value):
        raise UsageError(f"{where}: {TOLERANCE_HELP}, got {text!r}")
    return value


def parse_count(text: str, where: str, least: int = 1) -> int:
    """A positive (``least=1``) or non-negative (``least=0``) integer."""
    kind = "a positive integer" if least == 1 else f"an integer >= {least}"
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"{where}: expected {kind}, got {text!r}") from None
    if value < least:
        raise UsageError(f"{where}: expected {kind}, got {text!r}")
    return value


def parse_max_ranks(text: str, where: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise UsageError(f"{where}: max ranks must be an integer >= 1, got {text!r}")
    return int(text)


def parse_gbps(text: str, where: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"{where}: expected GB/s as a number, got {text!r}") from None
    if not value >= 0:
        raise UsageError(f"{where}: expected GB/s >= 0, got {text!r}")
    return value


def parse_sizes_mib(text: str, where: str) -> tuple[float, ...]:
    try:
        sizes = tuple(float(part) for part in _split(text))
    except ValueError:
        raise UsageError(f"{where}: {text!r} is not a comma-separated list of MiB, e.g. 1,8,32") from None
    if not sizes or any(not s > 0 for s in sizes):
        raise UsageError(f"{where}: message sizes must be positive MiB, got {text!r}")
    return sizes


def parse_bucket_caps(text: str, where: str) -> tuple[float, ...]:
    """``1,5,25,100``: DDP bucket caps in MB, each an arm of a profile."""
    try:
        sizes = tuple(float(part) for part in _split(text))
    except ValueError:
        raise UsageError(f"{where}: {text!r} is not a comma-separated list of sizes in MB, e.g. 1,5,25,100") from None
    if not sizes or any(not s > 0 or s != s or s == float("inf") for s in sizes):
        raise UsageError(f"{where}: bucket caps must be positive sizes in MB, got {text!r}")
    return sizes


def parse_bucket_lists(text: str, where: str) -> tuple[tuple[float, ...], ...]:
    """``1:25,5:25``: lists of DDP bucket caps in MB, bucket by bucket, each an arm of a profile."""
    lists = tuple(parse_bucket_caps(part.replace(":", ","), f"{where} {part!r}") for part in _split(text))
    if not lists:
        raise UsageError(f"{where}: give lists of sizes in MB, bucket by bucket, e.g. 1:25,5:25")
    return lists


def parse_names(text: str, where: str) -> tuple[str, ...]:
    """``a,b``: names, each checked where they are used."""
    names = tuple(_split(text))
    if not names:
        raise UsageError(f"{where}: give one or more names separated by commas")
    return names

