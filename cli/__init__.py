"""The ``streamrl`` command: ``up`` (the supervisor), ``run`` (one actor), and the operator
tools, one module per command group (status, dlq, replay, report)."""
