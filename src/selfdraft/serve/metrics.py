"""Prometheus metrics of one server (its own registry, so several servers can live in one process).

Counters and histograms are updated from the engine thread and the HTTP handlers
(prometheus_client is thread-safe); `render()` gives the text exposition for GET /metrics.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from selfdraft.decode import RoundStats

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, gamma: int) -> None:
        self.gamma = gamma
        self.registry = r = CollectorRegistry()
        self.requests = Counter("selfdraft_requests", "Finished requests by endpoint and finish reason "
                                "(stop, length, cancelled, error)", ["endpoint", "finish_reason"], registry=r)
        self.rejected = Counter("selfdraft_rejected_requests", "Requests refused before running, by HTTP status",
                                ["status"], registry=r)
        self.header_timeouts = Counter("selfdraft_header_timeouts", "Connections closed because a request's "
                                       "headers did not arrive within the header timeout", registry=r)
        self.prompt_tokens = Counter("selfdraft_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.output_tokens = Counter("selfdraft_output_tokens", "Tokens committed by the target", registry=r)
        self.rounds = Counter("selfdraft_spec_rounds", "Speculative rounds (one per request per step)", registry=r)
        self.round_tokens = Counter("selfdraft_spec_round_tokens", "Tokens committed by speculative rounds "
                                    "(accepted drafts + 1); tau = this / selfdraft_spec_rounds_total", registry=r)
        self.draft_tokens = Counter("selfdraft_spec_draft_tokens", "Draft tokens sent to verification", registry=r)
        self.accepted_tokens = Counter("selfdraft_spec_accepted_tokens", "Draft tokens accepted", registry=r)
        self.tau = Gauge("selfdraft_spec_tau", "Mean committed tokens per round since start (tau)", registry=r)
        self.position_tried = Counter("selfdraft_spec_position_tried", "Rounds where draft k was verified with "
                                      "drafts 1..k-1 accepted", ["position"], registry=r)
        self.position_accepted = Counter("selfdraft_spec_position_accepted", "Rounds where draft k was accepted",
                                         ["position"], registry=r)
        self.acceptance = Gauge("selfdraft_spec_acceptance_rate", "Acceptance of draft k given drafts 1..k-1 "
                                "accepted, since start", ["position"], registry=r)
        self.verify_tokens = Histogram("selfdraft_verify_tokens_per_step", "Tokens verified in one engine step "
                                       "(sum over requests of drafts + 1)", buckets=TOKEN_BUCKETS, registry=r)
        self.batch_size = Histogram("selfdraft_batch_requests_per_step", "Requests decoded in one engine step",
                                    buckets=TOKEN_BUCKETS, registry=r)
        self.step_seconds = Histogram("selfdraft_step_seconds", "Wall time of one engine step",
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("selfdraft_time_to_first_token_seconds", "Arrival to first token committed",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("selfdraft_request_latency_seconds", "Arrival to last token",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("selfdraft_queue_depth", "Requests admitted but not yet decoding", registry=r)
        self.running = Gauge("selfdraft_running_requests", "Requests in the decoding batch", registry=r)
        self._tried = [0] * gamma
        self._accepted = [0] * gamma
        self._rounds = self._round_tokens = 0

    def observe_step(self, rounds: list[RoundStats], seconds: float) -> None:
        """One engine step: each decoding request's round."""
        if not rounds:
            return
        self.step_seconds.observe(seconds)
        self.batch_size.observe(len(rounds))
        self.verify_tokens.observe(sum(r.proposed + 1 for r in rounds))
        for r in rounds:
            self.rounds.inc()
            self.round_tokens.inc(r.accepted + 1)
            self.draft_tokens.inc(r.proposed)
            self.accepted_tokens.inc(r.accepted)
            self._rounds += 1
            self._round_tokens += r.accepted + 1
            for k in range(1, min(r.depth, r.accepted + 1, self.gamma) + 1):  # draft k verified after k-1 accepted
                hit = r.accepted >= k
                self.position_tried.labels(str(k)).inc()
                self._tried[k - 1] += 1
                if hit:
                    self.position_accepted.labels(str(k)).inc()
                    self._accepted[k - 1] += 1
                self.acceptance.labels(str(k)).set(self._accepted[k - 1] / self._tried[k - 1])
        self.tau.set(self._round_tokens / self._rounds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
