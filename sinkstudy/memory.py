"""Memory as the benchmarks measure it (`make bench*`): the process's resident set (`rss_kib`, from
/proc/self/status) and its peak over a block of work (`PeakRSS`: VmHWM reset through /proc/self/clear_refs
before the block where Linux allows it, else the process-lifetime ru_maxrss delta, marked inexact)."""

from __future__ import annotations

import resource


def rss_kib(field: str = "VmRSS") -> int | None:
    """A /proc/self/status memory field in KiB (VmRSS: resident now; VmHWM: its peak), None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakRSS:
    """`with PeakRSS() as p: work()`, then `p.kib`: the most the resident set grew during the block; `p.exact`
    False where only the lifetime maximum was available (a block that did not raise it reads 0)."""

    def __enter__(self) -> "PeakRSS":
        self.exact = reset_peak()
        self._before = rss_kib("VmRSS") if self.exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return self

    def __exit__(self, *exc) -> None:
        after = rss_kib("VmHWM") if self.exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        self.kib = after - self._before
