"""Adapter popularity: each adapter's share of recent requests, from the pods' own counters.

Why the pods' counters (GetSlots' `AdapterState.requests_total`): every request lands on some
pod, whichever gateway sent it (and however many gateways there are), and the service polls
every pod already; counts kept by gateways would need every gateway to report and a sum. A
pod's counter only grows while the pod lives, so the service adds the difference between two
polls (a count lower than the last one means the pod restarted: all of it is new).

Recent: the counts decay exponentially with a half-life, so an adapter that was hot an hour
ago is not replicated now, and a newly hot one is noticed within a few polls. The state is
this process's memory: a restarted service learns it again from the next polls (the counters
the pods report since their start count as new then, which only makes the first view longer).
"""

from __future__ import annotations

_FORGET = 1e-3  # decayed weights below this are dropped (with 10,000 adapters the tail is long)


class Popularity:
    def __init__(self, half_life: float = 120.0) -> None:
        self.half_life = half_life
        self.weight: dict[str, float] = {}  # adapter -> its requests, decayed
        self._seen: dict[tuple[str, str], int] = {}  # (pod, adapter) -> the count last polled
        self._at: float | None = None

    def observe(self, pod: str, counts: dict[str, int]) -> None:
        """One poll of `pod`: its request count per adapter since it started."""
        for name, total in counts.items():
            before = self._seen.get((pod, name), 0)
            self._seen[(pod, name)] = total
            new = total - before if total >= before else total
            if new > 0:
                self.weight[name] = self.weight.get(name, 0.0) + new

    def forget_pod(self, pod: str) -> None:
        for key in [k for k in self._seen if k[0] == pod]:
            del self._seen[key]

    def decay(self, now: float) -> None:
        """Age every weight to `now` (monotonic seconds); call once a poll round."""
        if self._at is not None and now > self._at:
            factor = 0.5 ** ((now - self._at) / self.half_life)
            self.weight = {n: w * factor for n, w in self.weight.items() if w * factor >= _FORGET}
        self._at = now

    def share(self, name: str) -> float:
        total = sum(self.weight.values())
        return self.weight.get(name, 0.0) / total if total > 0 else 0.0

    def shares(self) -> dict[str, float]:
        """Each adapter's fraction of the recent requests (they sum to 1; empty before any)."""
        total = sum(self.weight.values())
        return {n: w / total for n, w in self.weight.items()} if total > 0 else {}
