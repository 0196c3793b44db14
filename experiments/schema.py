"""What every config reader in `experiments` shares: the one-line config error and the merge of
overrides into a config. Its own module so that the study schema (`experiments.study`) and the
demo's build section (`experiments.demo.build`) both import it without importing each other."""

from __future__ import annotations

import copy

from sinkstudy import SinkstudyError


class StudyConfigError(SinkstudyError):
    pass


def deep_merge(a: dict, b: dict) -> dict:
    """`b` merged into a copy of `a` (nested mappings merged, everything else replaced)."""
    out = copy.deepcopy(a)
    for k, v in b.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out
