"""What a flag accepts: a Domain is a test and the words that name it (in --help and in the error
line). config.py declares one beside each field; check_flags tests every value against it.
"""

import json
import math
from collections.abc import Callable
from dataclasses import dataclass

@dataclass(frozen=True)
class Domain:
    """The values a flag accepts: a test and the words that name them (--help, the error)."""
    text: str
    test: Callable[[object], bool]

    def allows(self, value):
        values = value if isinstance(value, list) else [value]
        return all(self.test(v) for v in values)


def number(text, test):
    """A numeric domain: finite numbers (NaN and inf fail) that pass test."""
    def finite_and(v):
        real = isinstance(v, (int, float)) and not isinstance(v, bool)
        return real and math.isfinite(v) and test(v)
    return Domain(text, finite_and)


def at_least(low):
    return number(f">= {low}", lambda v: v >= low)


def greater_than(low):
    return number(f"> {low}", lambda v: v > low)


def between(low, high, low_open=False, high_open=False):
    text = f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    return number(text, lambda v: (v > low if low_open else v >= low)
                  and (v < high if high_open else v <= high))


def one_of(*values):
    return Domain("one of " + ", ".join(values), lambda v: v in values)


def json_object(schema=None):
    """A JSON object (a dict once parsed); with a schema {key: (type, Domain or None)} only those
    keys, of those types."""
    def test(value):
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                return False
        if not isinstance(value, dict):
            return False
        return schema is None or all(k in schema and valid(v, *schema[k]) for k, v in value.items())
    keys = "" if schema is None else " with keys " + ", ".join(
        f"{k} ({getattr(kind, '__name__', kind)})" for k, (kind, _) in schema.items())
    return Domain("a JSON object" + keys, test)


# JSON values that are not one Python type
IDS, ID_LISTS = "a list of token ids", "a list of non-empty token-id lists"
WORDS, BIAS = "a list of non-empty strings", "an object {token id: finite number}"


def valid(value, kind, domain):
    """A JSON value of the given kind (a type, or one of the kinds above) within domain."""
    ints = lambda v: isinstance(v, list) and all(type(i) is int for i in v)  # noqa: E731
    if kind in (IDS, ID_LISTS):
        return ints(value) if kind == IDS else isinstance(value, list) and all(
            ints(v) and v for v in value)
    if kind == WORDS:
        return isinstance(value, list) and all(isinstance(v, str) and v for v in value)
    if kind == BIAS:
        return isinstance(value, dict) and all(
            k.isdigit() and FINITE.allows(v) for k, v in value.items())
    if kind is bool:
        return isinstance(value, bool)
    typed = isinstance(value, kind) and not isinstance(value, bool)
    typed = typed or kind is float and type(value) is int
    return typed and (domain is None or domain.allows(value))


FINITE = number("finite", lambda v: True)
JSON_OBJECT = json_object()
