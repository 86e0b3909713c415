"""Bytes for people: ``1536 -> '1.50 KiB'``, and the unit an axis of byte counts reads best in.

Every table, report and picture of ckptlib writes bytes with :func:`format_bytes`, so the same
size reads the same everywhere; a plot scales its axis with :func:`unit_for`.
"""

from __future__ import annotations

import math
import numbers

from ckptlib._arguments import got, integer

__all__ = ["format_bytes", "unit_for"]

_UNITS = (("B", 1), ("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30))


def format_bytes(nbytes: float, digits: int = 2) -> str:
    """``1536 -> '1.50 KiB'``: bytes in binary units, for tables, reports and pictures.

    ``digits``: decimals after the point in KiB and up (whole bytes have none); the graphs'
    boxes use 1.

    >>> format_bytes(512), format_bytes(3 * 2**20), format_bytes(float("nan"))
    ('512 B', '3.00 MiB', 'nan B')
    >>> format_bytes(1536, digits=1)
    '1.5 KiB'
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Real):
        raise TypeError(
            f"format_bytes: nbytes must be a number of bytes (int or float), {got(nbytes)}."
        )
    integer(digits, "digits (decimals shown)", least=0, where="format_bytes")
    if not math.isfinite(nbytes):
        return f"{nbytes} B"  # a table cell that says what it is, rather than a crash
    power = 0
    while abs(nbytes) >= 1024 and power < len(_UNITS) - 1:
        nbytes, power = nbytes / 1024, power + 1
    return f"{int(nbytes)} B" if power == 0 else f"{nbytes:.{digits}f} {_UNITS[power][0]}"


def unit_for(max_bytes: float) -> tuple[str, int]:
    """The unit an axis of values up to ``max_bytes`` reads best in: ``(name, bytes in one)``, the
    largest of B, KiB and MiB that ``max_bytes`` holds at least twice.

    >>> unit_for(3 * 2**20), unit_for(1500), unit_for(0)
    (('MiB', 1048576), ('B', 1), ('B', 1))
    """
    return next(
        ((name, size) for name, size in reversed(_UNITS[:3]) if max_bytes >= 2 * size), _UNITS[0]
    )
