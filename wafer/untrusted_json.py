"""JSON from outside the process (request bodies, what a model or a sandboxed program writes), parsed
with a bound on its nesting.

`json.loads` recurses once a level, in C, up to the interpreter's recursion limit (1000), and raises
RecursionError past it; that is not safe to lean on. At the limit, a garbage collection that runs a
callback or a finalizer in the same thread needs frames the thread no longer has, and CPython ends
the whole process ("Fatal Python error: _Py_CheckRecursiveCall: Cannot recover from stack
overflow"): a fuzzed request nested 2,000 deep did that to a server under test. So the nesting is
measured first, over the raw text, and a text nested deeper than MAX_DEPTH is refused as bad JSON
before it is parsed, as serde_json refuses past 128 levels by default.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

# Deeper than any request needs: a tool's or response format's schema may be 64 levels (its own
# bound, server/tools.py) inside a body's half a dozen.
MAX_DEPTH = 128

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_STEP = np.zeros(256, dtype=np.int8)  # a byte's change of the nesting: +1 opens, -1 closes, 0 else
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1


class TooDeep(ValueError):
    """A JSON text nested deeper than MAX_DEPTH."""


def too_deep(raw: bytes | str) -> bool:
    """Whether the text's arrays and objects nest deeper than MAX_DEPTH (brackets inside strings do
    not count). Text that is not JSON may be judged either way: parsing refuses it anyway, as it
    refuses what is not text at all (json.loads's TypeError)."""
    if not isinstance(raw, (str, bytes, bytearray)):
        return False
    opens = ("[", "{") if isinstance(raw, str) else (b"[", b"{")
    if raw.count(opens[0]) + raw.count(opens[1]) <= MAX_DEPTH:  # the common case: nothing to scan
        return False
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else bytes(raw)
    steps = _STEP[np.frombuffer(_STRING.sub(b"", data), dtype=np.uint8)]
    return bool(steps.size) and int(steps.cumsum(dtype=np.int32).max()) > MAX_DEPTH


def loads(raw: bytes | str) -> Any:
    """`json.loads`, refusing (TooDeep, a ValueError) a text nested deeper than MAX_DEPTH."""
    if too_deep(raw):
        raise TooDeep(f"nested more than {MAX_DEPTH} levels deep")
    return json.loads(raw)
