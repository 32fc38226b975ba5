"""The broker: Redis Streams with consumer groups, the atomic hand-off scripts, shards, the
claim check, ACL users. It moves bytes between named streams and knows nothing of RL: the
pipeline's names, messages and roles are in :mod:`streamrl.protocol`."""
