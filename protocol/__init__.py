"""The pipeline protocol: the messages that cross the streams, every stream, group, key and
counter name of a run, the roles and the operations each performs (their ACL grants derive
from it), and admission accounting. Built on the broker (:mod:`streamrl.queues`)."""
