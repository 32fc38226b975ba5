"""Helpers for tests and benchmarks, kept out of production code (installed as
``streamrl.testing``): ``wait.wait_until`` for conditions, ``messages.make_trajectory`` for
well-formed messages, ``serve_model`` for real ``streamrl serve-model`` processes,
``processes.descendants`` for what a test must not leave running."""
