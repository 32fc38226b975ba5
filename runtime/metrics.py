"""Prometheus metrics of an actor process, served on ``/metrics`` (``metrics.port``; 0: off).

What is recorded, by whom:
- the runtime (:mod:`runtime.serve`), for every handle-style actor: messages handled,
  handling latency (histogram), retries, dead letters (by reason class), the lag and
  pending count of the downstream group it watches for backpressure;
- from the outputs the runtime publishes: sandbox outcomes (``Executed``: ok / nonzero /
  timeout / oom / not run), rewards per domain and split (``Trajectory``: histogram, and the
  last group mean as a gauge, so evaluation results per domain show on a dashboard);
- from the learner's step metrics (:func:`record_step`): staleness histogram, step and wait
  seconds, busy fraction; recorded by the archiver (following the ``metrics`` stream) and
  by the learner's own process;
- the learner's own process (:func:`record_learner_step`, :func:`record_dropped_stale`,
  :func:`record_step_overdue`): steps, step latency (histogram), the staleness of every
  trained group (histogram), groups dropped as stale, steps past their deadline, loss, grad
  norm, KL, policy version, trained groups, samples and rewards per domain;
- the scheduler (:func:`record_admission`, :func:`record_admitted`,
  :func:`record_eval_round`): training groups admitted per domain, evaluation rounds
  started, the admission headroom and which bound holds admission at zero;
- the executor (:func:`record_sandbox_fleet`, every few seconds): each Docker sandbox
  backend's containers starting and running now, and the containers it created, the
  leaked ones its sweeps found and reaped, the sessions it refused for their age.

Every metric is defined once, here, and a process records only what it does, so one scrape
target never shows the same series from two sources (the archiver and the learner record
the step metrics with the same meaning, each on its own endpoint: tell them apart by the
scrape target, or scrape only one of them).

Metrics are process-local (prometheus_client's default registry) and cost a few counter
increments per message. With ``prometheus_client`` not installed, recording is a no-op and
:func:`start_metrics_server` raises a clear error.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import structlog

from streamrl.protocol.messages import Executed, StepMetrics, Trajectory

if TYPE_CHECKING:
    from streamrl.sandbox.docker import DockerStatistics

log = structlog.get_logger()

try:
    import prometheus_client as prom
except ImportError:  # pragma: no cover - exercised only without the dependency
    prom = None  # type: ignore[assignment]

STALENESS_BUCKETS = (0, 1, 2, 3, 4, 8, 16)
REWARD_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
BLOCKED_REASONS = ("staleness", "limit", "backlog", "stopped", "sft")
"""Why admission is at zero (:func:`record_admission`), one gauge series each ("sft": the
learner trains on its data set, ``learner.mode = "sft"``, and takes no training groups)."""
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
            buckets=REWARD_BUCKETS,
        )
        self.reward_last = prom.Gauge(
            "streamrl_group_reward", "Mean reward of the last group", ["run", "domain", "split"]
        )
        self.staleness = prom.Histogram(
            "streamrl_staleness_versions", "Max staleness seen per learner step", ["run"],
            buckets=STALENESS_BUCKETS,
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
        # the learner's own process
        self.steps = prom.Counter("streamrl_learner_steps", "Learner steps published", ["run"])
        self.step_latency = prom.Histogram(
            "streamrl_learner_step_latency_seconds", "Seconds per learner step (training)",
            ["run"], buckets=LATENCY_BUCKETS,
        )
        self.trained_staleness = prom.Histogram(
            "streamrl_trained_staleness_versions",
            "Staleness of each trained group: versions between its oldest token and the step",
            ["run"], buckets=STALENESS_BUCKETS,
        )
        self.dropped_stale = prom.Counter(
            "streamrl_learner_dropped_stale", "Groups dropped as too stale to train", ["run"]
        )
        self.steps_overdue = prom.Counter(
            "streamrl_learner_steps_overdue",
            "Learner steps still running learner.step_deadline_s after they began", ["run"],
        )
        self.loss = prom.Gauge("streamrl_learner_loss", "Loss of the last step", ["run"])
        self.grad_norm = prom.Gauge(
            "streamrl_learner_grad_norm", "Gradient norm (before clipping) of the last step",
            ["run"],
        )
        self.kl = prom.Gauge(
            "streamrl_learner_kl",
            "KL of the last step: to the reference model (ref, k3) and to the sampling "
            "policy (old, approximate)", ["run", "to"],
        )
        self.policy_version = prom.Gauge(
            "streamrl_policy_version", "Latest policy version the learner published", ["run"]
        )
        self.trained_groups = prom.Counter(
            "streamrl_learner_groups", "Groups trained", ["run", "domain"]
        )
        self.trained_samples = prom.Counter(
            "streamrl_learner_samples", "Samples trained", ["run", "domain"]
        )
        self.trained_reward = prom.Histogram(
            "streamrl_learner_reward", "Reward per trained sample", ["run", "domain"],
            buckets=REWARD_BUCKETS,
        )
        # the scheduler
        self.admitted = prom.Counter(
            "streamrl_admitted", "Training groups admitted", ["run", "domain"]
        )
        self.eval_rounds = prom.Counter(
            "streamrl_eval_rounds", "Held-out evaluation rounds started", ["run"]
        )
        self.headroom = prom.Gauge(
            "streamrl_admission_headroom", "Training groups admissible at the last check",
            ["run"],
        )
        self.blocked = prom.Gauge(
            "streamrl_admission_blocked",
            "1 for the bound that held admission at zero at the last check, else 0",
            ["run", "reason"],
        )
        # the executor's Docker sandbox backends
        self.containers = prom.Gauge(
            "streamrl_sandbox_containers",
            "Docker sandbox containers being created (starting) and live (running), per image",
            ["run", "image", "state"],
        )
        self.fleet = prom.Counter(
            "streamrl_sandbox_fleet",
            "Docker sandbox fleet events per image: containers created, leaked containers of "
            "other executors found and reaped by the sweeps, sessions expired",
            ["run", "image", "event"],
        )
        self.fleet_seen: dict[tuple[str, str], int] = {}  # (backend instance, event) -> count


_metrics: _Metrics | None = None


def metrics() -> _Metrics | None:
    """The process's metrics (created on first use), or None without prometheus_client."""
    global _metrics
    if _metrics is None and prom is not None:
        _metrics = _Metrics()
    return _metrics


def start_metrics_server(port: int, addr: str = "127.0.0.1") -> Any:
    """Serve ``/metrics`` on ``addr:port`` from a daemon thread (``port`` -1 or 0: a free
    port, logged); returns the server (``server.server_port``)."""
    if prom is None:
        raise RuntimeError("ops.metrics_port is set but prometheus_client is not installed")
    metrics()
    server, _thread = prom.start_http_server(max(port, 0), addr=addr)
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


def record_learner_step(
    run: str,
    step: StepMetrics,
    groups: Sequence[Trajectory],
    staleness: Sequence[int],
    *,
    kl_ref: float,
    approx_kl: float,
) -> None:
    """One published learner step: ``groups`` trained, ``staleness[i]`` versions old each."""
    if (m := metrics()) is None:
        return
    record_step(run, step)
    m.step_latency.labels(run).observe(step.step_seconds)
    for s in staleness:
        m.trained_staleness.labels(run).observe(s)
    m.loss.labels(run).set(step.loss)
    m.grad_norm.labels(run).set(step.grad_norm)
    m.kl.labels(run, "ref").set(kl_ref)
    m.kl.labels(run, "old").set(approx_kl)
    for g in groups:
        domain = g.rollout.task.domain
        m.trained_groups.labels(run, domain).inc()
        m.trained_samples.labels(run, domain).inc(len(g.rewards))
        for r in g.rewards:
            m.trained_reward.labels(run, domain).observe(r)
    m.policy_version.labels(run).set(step.policy_version)
    m.steps.labels(run).inc()


def record_policy_version(run: str, version: int) -> None:
    if (m := metrics()) is not None:
        m.policy_version.labels(run).set(version)


def record_dropped_stale(run: str) -> None:
    if (m := metrics()) is not None:
        m.dropped_stale.labels(run).inc()


def record_step_overdue(run: str) -> None:
    if (m := metrics()) is not None:
        m.steps_overdue.labels(run).inc()


def record_admission(run: str, headroom: int, blocked: str | None) -> None:
    """The scheduler's last check: ``headroom`` groups admissible; ``blocked`` the bound
    (one of :data:`BLOCKED_REASONS`) that holds it at zero, None when it is not."""
    if (m := metrics()) is None:
        return
    m.headroom.labels(run).set(headroom)
    for reason in BLOCKED_REASONS:
        m.blocked.labels(run, reason).set(1 if reason == blocked else 0)


def record_admitted(run: str, domains: Iterable[str]) -> None:
    """Training groups admitted, one domain name per group."""
    if (m := metrics()) is not None:
        for domain in domains:
            m.admitted.labels(run, domain).inc()


FLEET_STATES = ("starting", "running")
FLEET_EVENTS = ("created", "leaked", "reaped", "expired")


def record_sandbox_fleet(run: str, image: str, instance: str,
                         stats: DockerStatistics) -> None:
    """A Docker backend's counts (sandbox/docker.py ``DockerStatistics``): the gauges set,
    the counters advanced by what the backend ``instance`` counted since its last record."""
    if (m := metrics()) is None:
        return
    for state in FLEET_STATES:
        m.containers.labels(run, image, state).set(getattr(stats, state))
    for event in FLEET_EVENTS:
        count = getattr(stats, event)
        seen = m.fleet_seen.get((instance, event), 0)
        if count > seen:
            m.fleet.labels(run, image, event).inc(count - seen)
        m.fleet_seen[(instance, event)] = count


def record_eval_round(run: str) -> None:
    if (m := metrics()) is not None:
        m.eval_rounds.labels(run).inc()
