"""What `/metrics` reports, through `prometheus_client` (as vLLM's server does): counters, gauges and
histograms in a registry of the server's own (no process-global state), written in Prometheus' text format.
Written by the worker thread and the request handlers (the client's metrics are thread-safe)."""

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)  # seconds
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)  # seconds per token
ACCEPT_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16)  # tokens committed per round


class Metrics:
    """The server's metrics (names as exposed: `glance_requests_total`, ...)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()

        def counter(name: str, doc: str, labels=()):
            return Counter(name, doc, labels, registry=r)  # exposed as name_total

        def gauge(name: str, doc: str):
            return Gauge(name, doc, registry=r)

        self.requests = counter("glance_requests", "Requests accepted into the queue")
        self.rejected = counter("glance_requests_rejected", "Requests refused with a 429: the queue was full")
        self.finished = counter("glance_requests_finished", "Requests finished, by finish reason", ("reason",))
        self.prompt_tokens = counter("glance_prompt_tokens", "Prompt tokens of finished requests")
        self.completion_tokens = counter("glance_completion_tokens", "Tokens generated for finished requests")
        self.rounds = counter("glance_rounds", "Decoding rounds of finished requests")
        self.draft_passes = counter("glance_draft_passes", "Draft passes of finished requests")
        self.batch_rounds = counter("glance_batch_rounds", "Rounds the batch ran")
        self.batch_sequences = counter("glance_batch_sequences", "Sequences in the batch's rounds, summed")
        self.queue_depth = gauge("glance_queue_depth", "Requests waiting for a slot")
        self.batch_size = gauge("glance_batch_size", "Sequences in the last round")
        self.max_batch = gauge("glance_max_batch", "The decoder's slots")
        self.ttft = Histogram("glance_time_to_first_token_seconds", "Time from arrival to the first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("glance_inter_token_latency_seconds", "Seconds per token between a request's chunks",
                             buckets=ITL_BUCKETS, registry=r)
        self.accepted = Histogram("glance_accepted_tokens_per_round", "Tokens committed per drafted round",
                                  buckets=ACCEPT_BUCKETS, registry=r)

    def observe_round(self, sequences: int) -> None:
        self.batch_size.set(sequences)
        self.batch_rounds.inc()
        self.batch_sequences.inc(sequences)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_itl(self, seconds_per_token: float, tokens: int) -> None:
        for _ in range(tokens):  # one observation per token (a chunk of n tokens: n at its mean)
            self.itl.observe(seconds_per_token)

    def observe_request(self, stats, tokens: int, seconds: float, reason: str) -> None:
        self.finished.labels(reason=reason).inc()
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.completion_tokens.inc(tokens)
        self.rounds.inc(stats.rounds)
        self.draft_passes.inc(stats.draft_passes)
        for i in stats.drafted:  # drafted rounds (every round of autoregression)
            self.accepted.observe(stats.accepted_lengths[i])

    def text(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()
