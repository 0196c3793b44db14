"""A study config that may hold the demo's `build:` section: the study's own loader (`experiments.study.config`),
handed the demo's build reader (`experiments.demo.build.validate_build`). The study never imports the demo; the
commands that run studies (`sinkstudy run`, `demo`, `paper`) load configs through here."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from experiments.demo.build import validate_build
from experiments.study import config


def load_study(path: str | os.PathLike, *, out: str | os.PathLike | None = None, overrides: dict | None = None) -> config.Study:
    return config.load_study(path, out=out, overrides=overrides, build=validate_build)


def validate(raw: Any, *, path: Path | None = None, out: str | os.PathLike | None = None) -> config.Study:
    return config.validate(raw, path=path, out=out, build=validate_build)
