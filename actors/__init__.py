"""The actors: scheduler, generator, executor, verifier, learner, monitor, archiver. Each is
its configuration plus a handler served by :mod:`streamrl.runtime`."""
