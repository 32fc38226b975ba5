"""The actor runtime: the serve loop and its policies (backpressure, retry, delivery and time
limits, dead letters), an actor's context (Redis, config, consumers), metrics, logs, and the
process entry that serves one actor until it is told to drain."""
