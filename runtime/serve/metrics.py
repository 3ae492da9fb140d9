"""Prometheus metrics for /metrics, in a registry of their own (one per server).

Two sets: ours (`deepinfer_*`), and vLLM's names and labels (`vllm:*`, each with `model_name`), so
dashboards and alerts written for vLLM -- its own Grafana dashboard among them -- work unchanged.
vLLM's finished_reason is stop (EOS, a stop token or string), length (max_tokens, the context) or
abort (cancelled, failed); its KV-cache usage is the share of sequence slots running sequences hold
(a free slot's cached prefix is evictable, as vLLM's free cached blocks are)."""

import functools

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .protocol import FINISH_REASONS

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
                   960.0, 1920.0, 7680.0)  # (vLLM's, for whole requests)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000, 500000,
                 1000000)


class Metrics:
    def __init__(self, model_name: str = ""):
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
        self.vllm = _VLLMMetrics(r, model_name)

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

    def submitted(self, prompt_tokens: int):
        self.prompt_tokens.inc(prompt_tokens)
        self.vllm.prompt_tokens.inc(prompt_tokens)

    def generated(self, tokens: int):
        self.generation_tokens.inc(tokens)
        self.vllm.generation_tokens.inc(tokens)

    def first_token(self, ttft: float):
        self.ttft.observe(ttft)
        self.vllm.ttft.observe(ttft)

    def finished(self, result, seconds: float):
        """A sequence's `result` ended, `seconds` after its submission."""
        v = self.vllm
        if len(result.token_ids) > 1:
            self.tpot.observe(result.tpot)
            v.tpot.observe(result.tpot)
        for before, after in zip(result.token_times, result.token_times[1:]):
            v.inter_token.observe(after - before)
        v.success(finished_reason=FINISH_REASONS.get(result.finish_reason, "abort"))  # (cancelled, error).inc()
        v.e2e.observe(seconds)
        v.queue.observe(result.queue_time)
        if result.token_times:  # (prefill: slot to first token; decode: first token to last)
            v.prefill.observe(max(result.ttft - result.queue_time, 0.0))
            v.decode.observe(result.token_times[-1] - result.token_times[0])
        v.inference.observe(max(seconds - result.queue_time, 0.0))
        v.prompt_lengths.observe(len(result.prompt_ids))
        v.generation_lengths.observe(len(result.token_ids))
        v.max_generation.observe(len(result.token_ids))

    def scheduler(self, running: int, waiting: int, free_slots: int, max_seqs: int):
        self.running.set(running)
        self.waiting.set(waiting)
        self.free_slots.set(free_slots)
        self.vllm.running.set(running)
        self.vllm.waiting.set(waiting)
        self.vllm.kv_usage.set(running / max_seqs if max_seqs else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _VLLMMetrics:
    """vLLM's series (names, kinds, labels), each labelled with the served model's name."""

    def __init__(self, r: CollectorRegistry, model_name: str):
        def histogram(name, help, buckets, labels=()):
            return Histogram(f"vllm:{name}", help, ["model_name", *labels], buckets=buckets, registry=r).labels(model_name)

        self.running = Gauge("vllm:num_requests_running", "sequences holding a slot", ["model_name"], registry=r).labels(model_name)
        self.waiting = Gauge("vllm:num_requests_waiting", "requests waiting for a slot", ["model_name"], registry=r).labels(model_name)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "share of sequence slots in use (0 to 1)", ["model_name"],
                              registry=r).labels(model_name)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "prompt tokens", ["model_name"], registry=r).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "generated tokens", ["model_name"], registry=r).labels(model_name)
        success = Counter("vllm:request_success", "finished requests by finished_reason", ["model_name", "finished_reason"],
                          registry=r)
        self.success = functools.partial(success.labels, model_name=model_name)  # (finished_reason=...)
        self.ttft = histogram("time_to_first_token_seconds", "submission to first token", LATENCY_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "mean time per token after the first", LATENCY_BUCKETS)
        self.inter_token = histogram("inter_token_latency_seconds", "time between two tokens of a sequence", LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "submission to the last token", REQUEST_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "waiting for a sequence slot", REQUEST_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds", "slot taken to first token", REQUEST_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "first token to last", REQUEST_BUCKETS)
        self.inference = histogram("request_inference_time_seconds", "slot taken to last token", REQUEST_BUCKETS)
        self.prompt_lengths = histogram("request_prompt_tokens", "prompt tokens of a request", TOKEN_BUCKETS)
        self.generation_lengths = histogram("request_generation_tokens", "tokens a request generated", TOKEN_BUCKETS)
        self.max_generation = histogram("request_max_num_generation_tokens", "the most tokens a request's sequence "
                                        "generated", TOKEN_BUCKETS)

