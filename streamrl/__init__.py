"""streamrl: RL post-training for language models, every stage an actor on Redis Streams.

The design's folders install under this one name: ``streamrl.queues``, ``streamrl.actors``,
``streamrl.sandbox``, ``streamrl.learner``, ``streamrl.domains``, ``streamrl.inference``
(``pyproject.toml``, ``[tool.setuptools] package-dir``).
"""
