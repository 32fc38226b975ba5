"""Prometheus metrics of an actor process, served on ``/metrics`` (``metrics.port``; 0: off).

What is recorded, by whom:
- the runtime (:mod:`actors.runtime`), for every handle-style actor: messages handled,
  handling latency (histogram), retries, dead letters (by reason class), the lag and
  pending count of the downstream group it watches for backpressure;
- from the outputs the runtime publishes: sandbox outcomes (``Executed``: ok / nonzero /
  timeout / oom / not run), rewards per domain and split (``Trajectory``: histogram, and the
  last group mean as a gauge, so evaluation results per domain show on a dashboard);
- from the learner's step metrics (:func:`record_step`): staleness histogram, step and wait
  seconds, busy fraction.

Metrics are process-local (prometheus_client's default registry) and cost a few counter
increments per message. With ``prometheus_client`` not installed, recording is a no-op and
:func:`start_metrics_server` raises a clear error.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import structlog

from queues.messages import Executed, StepMetrics, Trajectory

log = structlog.get_logger()

try:
    import prometheus_client as prom
except ImportError:  # pragma: no cover - exercised only without the dependency
    prom = None  # type: ignore[assignment]

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class _Metrics:
    def __init__(self) -> None:
        assert prom is not None
        self.handled = prom.Counter(
            "streamrl_handled", "Messages handled and handed off", ["run", "stage"]
        )
        self.latency = prom.Histogram(
            "streamrl_handle_seconds", "Handling latency, retries included", ["run", "stage"],
            buckets=LATENCY_BUCKETS,
        )
        self.retries = prom.Counter("streamrl_retries", "Handler retries", ["run", "stage"])
        self.dead = prom.Counter(
            "streamrl_dead_letters", "Entries dead-lettered", ["run", "stage", "reason"]
        )
        self.lag = prom.Gauge(
            "streamrl_queue_lag", "Entries not yet delivered to a group", ["run", "stream"]
        )
        self.pending = prom.Gauge(
            "streamrl_queue_pending", "Entries delivered, not acknowledged", ["run", "stream"]
        )
        self.sandbox = prom.Counter(
            "streamrl_sandbox_outcomes", "Sandbox runs by outcome", ["run", "outcome"]
        )
        self.reward = prom.Histogram(
            "streamrl_reward", "Reward per sample", ["run", "domain", "split"],
            buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0),
        )
        self.reward_last = prom.Gauge(
            "streamrl_group_reward", "Mean reward of the last group", ["run", "domain", "split"]
        )
        self.staleness = prom.Histogram(
            "streamrl_staleness_versions", "Max staleness seen per learner step", ["run"],
            buckets=(0, 1, 2, 3, 4, 8, 16),
        )
        self.step_seconds = prom.Counter(
            "streamrl_learner_step_seconds", "Seconds the learner spent stepping", ["run"]
        )
        self.wait_seconds = prom.Counter(
            "streamrl_learner_wait_seconds", "Seconds the learner waited for groups", ["run"]
        )
        self.busy = prom.Gauge(
            "streamrl_learner_busy_fraction", "step / (step + wait) of the last step", ["run"]
        )


_metrics: _Metrics | None = None


def metrics() -> _Metrics | None:
    """The process's metrics (created on first use), or None without prometheus_client."""
    global _metrics
    if _metrics is None and prom is not None:
        _metrics = _Metrics()
    return _metrics


def start_metrics_server(port: int, addr: str = "127.0.0.1") -> Any:
    """Serve ``/metrics`` on ``addr:port`` from a daemon thread; returns the server."""
    if prom is None:
        raise RuntimeError("metrics.port is set but prometheus_client is not installed")
    metrics()
    server, _thread = prom.start_http_server(port, addr=addr)
    log.info("metrics served", addr=addr, port=server.server_port)
    return server


def record_handled(run: str, stage: str, seconds: float, outputs: Iterable[Any]) -> None:
    m = metrics()
    if m is None:
        return
    m.handled.labels(run, stage).inc()
    m.latency.labels(run, stage).observe(seconds)
    for message in outputs:
        if isinstance(message, Executed):
            for o in message.outcomes:
                m.sandbox.labels(run, _outcome(o)).inc()
        elif isinstance(message, Trajectory) and message.rewards:
            task = message.rollout.task
            for r in message.rewards:
                m.reward.labels(run, task.domain, task.split).observe(r)
            mean = sum(message.rewards) / len(message.rewards)
            m.reward_last.labels(run, task.domain, task.split).set(mean)


def _outcome(o: Any) -> str:
    if o.oom_killed:
        return "oom"
    if o.timed_out:
        return "timeout"
    if o.exit_code is None:
        return "not_run"
    return "ok" if o.exit_code == 0 else "nonzero"


def record_retry(run: str, stage: str) -> None:
    if (m := metrics()) is not None:
        m.retries.labels(run, stage).inc()


def record_dead(run: str, stage: str, reason: str) -> None:
    if (m := metrics()) is not None:
        m.dead.labels(run, stage, reason.split(":", 1)[0][:40]).inc()


def record_queue(run: str, stream: str, lag: int, pending: int) -> None:
    if (m := metrics()) is not None:
        m.lag.labels(run, stream).set(lag)
        m.pending.labels(run, stream).set(pending)


def record_step(run: str, step: StepMetrics) -> None:
    if (m := metrics()) is None:
        return
    m.staleness.labels(run).observe(step.max_staleness_seen)
    m.step_seconds.labels(run).inc(step.step_seconds)
    m.wait_seconds.labels(run).inc(step.wait_seconds)
    total = step.step_seconds + step.wait_seconds
    m.busy.labels(run).set(step.step_seconds / total if total > 0 else 0.0)
