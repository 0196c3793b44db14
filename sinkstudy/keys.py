"""The one key of everything sinkstudy reuses: a finished step (`experiments.study.kinds.step_key`), and the caches
whose entries are steps' inputs (a shared adaptation stage, self-distilled replies, a pretrained tower, a
converted GGUF checkpoint). `key(identity)` is the sha256 of the identity as canonical JSON (keys sorted, values
that JSON cannot hold as their `str`); what goes into an identity is its caller's to say (inputs by content, the
settings, the code), the hashing and its length are said here once.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

LENGTH = 24  # hex digits: 96 bits, no collision among the results of any study


def key(identity: Any) -> str:
    """The key of `identity` (JSON data: mappings, lists, strings, numbers)."""
    blob = json.dumps(identity, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:LENGTH]
