"""Instants at the API's edge are ISO 8601 text (`2026-11-01`, `2026-11-01T08:00:00Z`).

pydantic would also read a number as Unix time, in JSON or as numeric text: `2.6e-306` is
then 1970, and a key created with it is born expired. Here a number is always a mistake,
and is refused as one, as the OpenAPI schema (`format: date-time`) says.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import BeforeValidator


def _iso_only(value: object) -> object:
    if isinstance(value, datetime):
        return value
    if not isinstance(value, str):
        raise ValueError("an ISO 8601 date or date-time")
    try:
        float(value)
    except ValueError:
        return value
    raise ValueError("an ISO 8601 date or date-time, not a number")


Instant = Annotated[datetime, BeforeValidator(_iso_only)]
