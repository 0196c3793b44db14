"""Leaving torch.distributed cleanly when a data-parallel command ends (accelerate launch / torchrun)."""

from __future__ import annotations

import sys


def leave_process_group() -> None:
    """Destroy the default process group, if this process joined one.

    A process that exits without this can abort at interpreter shutdown (SIGABRT, "terminate called
    without an active exception"): gloo's worker threads outlive the group they belong to. Called
    on success only: after a failure another rank may still be inside a collective.
    """
    torch = sys.modules.get("torch")  # a command that never imported torch never joined a group
    if torch is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return
    torch.distributed.destroy_process_group()
