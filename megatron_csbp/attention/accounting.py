"""Bytes moved by attention collectives, per rank, per layer and per step.

Every transport records what this rank sends and receives for each collective it issues. The
numbers are logical bytes, computed from the sizes of the tensors handed to the collectives: an
all-gather of P shards of S bytes sends and receives (P-1)*S on every rank (the ring algorithm's
volume), a reduce-scatter the same, a ring shift one shard each way, an all-to-all the rows it
sends and receives. tests/test_traffic_collectives.py checks them equal to the bytes counted by a
wrapper around torch.distributed's collectives (2 gloo ranks, all-gather and ring transports).
What the wire carries on top (protocol headers, an all-reduce fallback's extra pass) is not counted.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, Tuple


@dataclass
class TrafficCounter:
    """sent/received bytes keyed by (layer number, phase) where phase is 'forward' or 'backward'."""

    sent: Dict[Tuple[int, str], int] = field(default_factory=lambda: defaultdict(int))
    received: Dict[Tuple[int, str], int] = field(default_factory=lambda: defaultdict(int))
    # Seconds this rank's compute stood waiting for a collective (the exposed communication):
    # the time inside wait() of a collective started earlier, and the whole time of a blocking one.
    # Seconds collectives were in flight: from posting to the end of their wait (an asynchronous
    # one overlaps the compute in between), the whole time of a blocking one. in flight - waited
    # is the communication hidden behind compute (an upper bound: a transfer may end before its
    # wait starts, and gloo's requests do not say when they did).
    # Read through `waited_s` / `in_flight_s`. On CUDA the three instants are CUDA events on the
    # compute stream (an NCCL wait() only makes the stream wait, so a host clock reads ~0); they
    # are converted, once complete, when the numbers are read (no synchronisation per transfer).
    _waited: Dict[Tuple[int, str], float] = field(default_factory=lambda: defaultdict(float))
    _in_flight: Dict[Tuple[int, str], float] = field(default_factory=lambda: defaultdict(float))
    _pending_events: list = field(default_factory=list)
    transfers: int = 0

    def record(self, layer: int, phase: str, sent: int, received: int) -> None:
        self.sent[(layer, phase)] += int(sent)
        self.received[(layer, phase)] += int(received)

    def record_transfer(self, layer: int, phase: str, posted, wait_start, wait_end) -> None:
        """One collective: posted at `posted`, waited for from `wait_start` to `wait_end`
        (`time.perf_counter()` seconds, or three CUDA events recorded on the compute stream; a
        blocking one has posted == wait_start)."""
        self.transfers += 1
        if isinstance(posted, float):
            self._timed((layer, phase), wait_end - wait_start, wait_end - posted)
        else:
            self._pending_events.append((layer, phase, posted, wait_start, wait_end))

    def _timed(self, key: Tuple[int, str], waited: float, in_flight: float) -> None:
        self._waited[key] += float(waited)
        self._in_flight[key] += float(in_flight)

    def _resolve(self) -> None:
        pending, self._pending_events = self._pending_events, []
        for layer, phase, posted, start, end in pending:
            end.synchronize()
            self._timed((layer, phase), start.elapsed_time(end) / 1e3, posted.elapsed_time(end) / 1e3)  # ms -> s

    @property
    def waited_s(self) -> Dict[Tuple[int, str], float]:
        self._resolve()
        return self._waited

    @property
    def in_flight_s(self) -> Dict[Tuple[int, str], float]:
        self._resolve()
        return self._in_flight

    def reset(self) -> None:
        self.__init__()  # every field back to its default, in place (callers hold this counter)

    @property
    def total_in_flight_s(self) -> float:
        return sum(self.in_flight_s.values())

    @property
    def total_waited_s(self) -> float:
        return sum(self.waited_s.values())

    @property
    def total_sent(self) -> int:
        return sum(self.sent.values())

    @property
    def total_received(self) -> int:
        return sum(self.received.values())

    @property
    def total(self) -> int:
        return self.total_sent + self.total_received

    def per_layer(self) -> Dict[int, Dict[str, int]]:
        layers: Dict[int, Dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for direction, counts in (("sent", self.sent), ("received", self.received)):
            for (layer, phase), v in counts.items():
                layers[layer][f"{phase}_{direction}"] += v
        return {k: dict(v) for k, v in sorted(layers.items())}


# One counter per process: a step's traffic is read and reset by the training loop or benchmark.
_COUNTER = TrafficCounter()


def traffic_counter() -> TrafficCounter:
    return _COUNTER
