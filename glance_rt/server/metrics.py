"""Server counters and histograms, written in Prometheus' text format (no client library needed)."""

import threading
from dataclasses import dataclass, field

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)  # seconds
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)  # seconds per token
ACCEPT_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16)  # tokens committed per round


@dataclass
class Histogram:
    buckets: tuple
    counts: list = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self):
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float, weight: int = 1) -> None:
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += weight
        self.total += value * weight
        self.n += weight

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts, strict=True)]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.n}', f"{name}_sum {self.total}", f"{name}_count {self.n}"]


class Metrics:
    """What /metrics reports. Written by the worker thread and the request handlers; read by /metrics."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests = 0  # accepted into the queue
        self.rejected = 0  # 429: queue full
        self.finished: dict[str, int] = {}  # by finish reason
        self.prompt_tokens = self.completion_tokens = self.rounds = self.draft_passes = 0
        self.queue_depth = 0
        self.batch_size = 0  # sequences in the last round
        self.max_batch = 1  # the decoder's slots
        self.batch_rounds = self.batch_sequences = 0  # rounds run, and the sequences in them summed
        self.ttft, self.itl = Histogram(TTFT_BUCKETS), Histogram(ITL_BUCKETS)
        self.accepted = Histogram(ACCEPT_BUCKETS)

    def observe_round(self, sequences: int) -> None:
        with self.lock:
            self.batch_size = sequences
            self.batch_rounds += 1
            self.batch_sequences += sequences

    def observe_ttft(self, seconds: float) -> None:
        with self.lock:
            self.ttft.observe(seconds)

    def observe_itl(self, seconds_per_token: float, tokens: int) -> None:
        with self.lock:
            self.itl.observe(seconds_per_token, tokens)

    def observe_request(self, stats, tokens: int, seconds: float, reason: str) -> None:
        with self.lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.prompt_tokens += stats.prompt_tokens
            self.completion_tokens += tokens
            self.rounds += stats.rounds
            self.draft_passes += stats.draft_passes
            for i in stats.drafted:  # drafted rounds (every round of autoregression)
                self.accepted.observe(stats.accepted_lengths[i])

    def text(self) -> str:
        with self.lock:
            lines = [
                "# TYPE glance_requests_total counter", f"glance_requests_total {self.requests}",
                "# TYPE glance_requests_rejected_total counter", f"glance_requests_rejected_total {self.rejected}",
                "# TYPE glance_requests_finished_total counter",
                *(f'glance_requests_finished_total{{reason="{r}"}} {n}' for r, n in sorted(self.finished.items())),
                "# TYPE glance_prompt_tokens_total counter", f"glance_prompt_tokens_total {self.prompt_tokens}",
                "# TYPE glance_completion_tokens_total counter",
                f"glance_completion_tokens_total {self.completion_tokens}",
                "# TYPE glance_rounds_total counter", f"glance_rounds_total {self.rounds}",
                "# TYPE glance_draft_passes_total counter", f"glance_draft_passes_total {self.draft_passes}",
                "# TYPE glance_queue_depth gauge", f"glance_queue_depth {self.queue_depth}",
                "# TYPE glance_batch_size gauge", f"glance_batch_size {self.batch_size}",
                "# TYPE glance_max_batch gauge", f"glance_max_batch {self.max_batch}",
                "# TYPE glance_batch_rounds_total counter", f"glance_batch_rounds_total {self.batch_rounds}",
                "# TYPE glance_batch_sequences_total counter",
                f"glance_batch_sequences_total {self.batch_sequences}",
                "# TYPE glance_time_to_first_token_seconds histogram",
                *self.ttft.lines("glance_time_to_first_token_seconds"),
                "# TYPE glance_inter_token_latency_seconds histogram",
                *self.itl.lines("glance_inter_token_latency_seconds"),
                "# TYPE glance_accepted_tokens_per_round histogram",
                *self.accepted.lines("glance_accepted_tokens_per_round"),
            ]
        return "\n".join(lines) + "\n"
