"""`sinkstudy clean [DIR ...]`: remove what killed runs left behind (temporaries, lock files)."""

from __future__ import annotations

from pathlib import Path

from experiments.cli.closing import Summary
from experiments.cli.options import add_progress_options
from sinkstudy import SinkstudyError
from sinkstudy.io import cache_root, remove_stale_temps


def register(subparsers) -> None:
    p = subparsers.add_parser("clean", help="remove stale temporaries (.NAME.tmp-*) and lock files of dead runs "
                                            "under runs/ and the sinkstudy cache",
                              description="Remove what killed runs left behind: temporaries (.NAME.tmp-*) whose writer is "
                              "dead and lock files no process holds, under each DIR (default runs/ and the sinkstudy cache). "
                              "Finished results are never touched.")
    p.add_argument("dirs", nargs="*", metavar="DIR", help="directories to clean (default: runs and $SINKSTUDY_CACHE)")
    add_progress_options(p)
    p.set_defaults(func=run_clean)


def run_clean(args) -> Summary | int:
    missing = [d for d in args.dirs if not Path(d).is_dir()]
    if missing:
        raise SinkstudyError(f"not a directory: {', '.join(missing)}")
    dirs = [Path(d) for d in args.dirs] or [d for d in (Path("runs"), cache_root()) if d.is_dir()]
    removed = [p for d in dirs for p in remove_stale_temps(d, recursive=True)]
    for p in removed:
        print(f"removed {p}")
    print(f"sinkstudy clean: {len(removed)} stale item(s) removed under {', '.join(map(str, dirs)) or 'nothing'}")
    return Summary("clean", f"{len(removed)} stale temporary or lock file(s) of dead runs removed under "
                   f"{', '.join(map(str, dirs)) or 'nothing (no runs/ and no cache)'}", outputs=[],
                   next=["rerun the command that was killed: its finished steps are reused"] if removed else [])
