"""Memory and throughput figures the engine, the benchmarks and the diagnostics report."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch


def process_rss_bytes() -> int:
    """Resident set size of this process (Linux ``/proc``; psutil elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import psutil
        return psutil.Process().memory_info().rss


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (``VmHWM``)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def system_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil
    return psutil.virtual_memory().available


def cuda_allocated_bytes() -> int:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


@dataclass
class RequestMetrics:
    """Figures of one generation request."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    time_to_first_token: float = 0.0  # seconds from request start to the first new token
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0  # time of the decode steps (tokens after the first)
    selection_seconds: float = 0.0  # of the prefill: choosing and swapping in dynamic neurons
    computed_share: float = -1.0  # compute_mode token: MLP neurons computed per decode token; -1: n/a
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prompt cache

    @property
    def tokens_per_second(self) -> float:
        """Decode throughput: tokens produced by decode steps per decode second."""
        steps = self.generated_tokens - 1
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds > 0 else 0.0

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0


@dataclass
class RunningStats:
    """Counters a serving node keeps across requests."""

    succeeded: int = 0
    canceled: int = 0
    aborted: int = 0
    rejected: int = 0
    closed_early: int = 0  # constrained answers ended early to fit max_new_tokens
    loops_broken: int = 0  # constrained answers kept from repeating a span
    last_tokens_per_second: float = 0.0
    last_time_to_first_token: float = 0.0
    last_computed_share: float = -1.0  # per decode token, compute_mode token; -1: n/a
    _tps: list[float] = field(default_factory=list)

    def record(self, m: RequestMetrics) -> None:
        if m.computed_share >= 0:
            self.last_computed_share = m.computed_share
        if m.tokens_per_second > 0:
            self.last_tokens_per_second = m.tokens_per_second
            self._tps = (self._tps + [m.tokens_per_second])[-50:]
        self.last_time_to_first_token = m.time_to_first_token

    @property
    def average_tokens_per_second(self) -> float:
        return sum(self._tps) / len(self._tps) if self._tps else 0.0
