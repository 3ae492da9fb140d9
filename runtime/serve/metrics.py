"""Prometheus metrics for /metrics, in a registry of their own (one per server)."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("deepinfer_requests", "HTTP requests to /v1, by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("deepinfer_prompt_tokens", "prompt tokens submitted to the engine", registry=r)
        self.generation_tokens = Counter("deepinfer_generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("deepinfer_time_to_first_token_seconds", "submission to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("deepinfer_time_per_output_token_seconds", "mean time per token after the first, per sequence",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.waiting = Gauge("deepinfer_queue_length", "requests waiting for a sequence slot", registry=r)
        self.running = Gauge("deepinfer_running_sequences", "sequences holding a slot (prefilling or decoding)", registry=r)
        self.free_slots = Gauge("deepinfer_free_kv_slots", "sequence slots of the state pool that are free", registry=r)
        # Speculative decoding, by draft position (0: the first draft after a sequence's last token).
        self.drafted = Counter("deepinfer_spec_decode_draft_tokens", "drafts verified, by draft position", ["position"],
                               registry=r)
        self.accepted = Counter("deepinfer_spec_decode_accepted_tokens", "drafts accepted, by draft position", ["position"],
                                registry=r)
        self.acceptance = Gauge("deepinfer_spec_decode_acceptance_rate", "accepted / verified drafts since start, by "
                                "draft position", ["position"], registry=r)
        self.published: dict[int, tuple[int, int]] = {}  # draft position -> the totals counted so far
        # Prefix caching: prompts that reused a cached prefix, the prompt tokens not prefilled so, the
        # reuses that copied another slot's state, and cached prefixes dropped to make room.
        self.prefix = {name: Counter(f"deepinfer_prefix_cache_{name}", help, registry=r) for name, help in (
            ("hits", "prompts that reused a cached prefix"), ("hit_tokens", "prompt tokens reused, not prefilled"),
            ("copies", "reuses that copied the prefix from another slot (a running sequence's, n > 1)"),
            ("evictions", "cached prefixes dropped for another prompt"))}
        self.prefix_published = {name: 0 for name in self.prefix}

    def speculation(self, drafted: list[int], accepted: list[int]):
        """The engine's running totals per draft position, into the counters and rates."""
        for position, (n, a) in enumerate(zip(drafted, accepted)):
            label, (published_n, published_a) = str(position), self.published.get(position, (0, 0))
            self.drafted.labels(label).inc(n - published_n)
            self.accepted.labels(label).inc(a - published_a)
            self.acceptance.labels(label).set(a / n if n else 0.0)
            self.published[position] = (n, a)

    def prefix_cache(self, totals: dict[str, int]):
        """The engine's running prefix-cache totals, into the counters."""
        for name, total in totals.items():
            self.prefix[name].inc(total - self.prefix_published[name])
            self.prefix_published[name] = total

    def render(self) -> bytes:
        return generate_latest(self.registry)
