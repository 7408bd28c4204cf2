"""The one exception type the data pipeline raises for bad input."""

from __future__ import annotations


class DataError(ValueError):
    """Bad data input or an incompatible prepared directory.

    Subclasses ValueError so callers that validate configs can catch both; the message always
    names the offending key, file or path and how to fix it.
    """
