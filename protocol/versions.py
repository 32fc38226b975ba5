"""Which policy versions a follower of the ``weights`` stream believes.

The learner announces the versions it saves one after another: version k+1 after k (a
restarted learner announces its latest again; a fresh run starts from the base weights,
version 0). A ``WeightsPublished`` event is a claim: a follower (the scheduler's admission
bound, a generator's weight updates) takes an event only if its version is at most one past
the highest it took, the chain the run's own announcements form; an event further ahead
(a forged version 10^6) is refused and logged, so it can neither open the admission bound
nor make a generator load what it names. At start a follower walks the retained events from
the oldest (:meth:`VersionFollower.catch_up`), so a forged event on top of the stream is
refused there too.

Not covered: an event that continues the chain (version k+1 before the learner's own) is
taken; a generator then fails to load its path and keeps its weights
(``actors/generator.py``) until the learner's own k+1 arrives.
"""

from __future__ import annotations

import structlog

from streamrl.protocol.messages import WeightsPublished
from streamrl.queues.streams import EventReader

log = structlog.get_logger()

PAGE = 1000
"""Events read per call when catching up."""


class VersionFollower:
    """The highest version taken so far, and which events continue it (module docstring)."""

    def __init__(self) -> None:
        self.version = 0
        self.taken: list[WeightsPublished] = []
        """The events taken, oldest first (the last few: what a generator may load)."""

    def take(self, event: WeightsPublished) -> bool:
        """Whether ``event`` continues the chain (then it is the highest version if newer);
        one that does not is logged and refused."""
        if event.version < 0 or event.version > self.version + 1:
            log.warning("weights event refused: not the next version", version=event.version,
                        following=self.version, path=event.path[:300])
            return False
        self.version = max(self.version, event.version)
        self.taken = [*self.taken[-7:], event]
        return True

    def take_all(self, events: list[WeightsPublished]) -> list[WeightsPublished]:
        """The ones of ``events`` (in stream order) that continue the chain."""
        return [e for e in events if self.take(e)]

    async def catch_up(self, reader: EventReader) -> int:
        """Walk every retained event of ``reader``'s stream from the oldest, in pages, taking
        those that continue the chain (the oldest one starts it); returns the version
        reached. The reader then follows from the newest event."""
        newest = await reader.newest_id()  # an entry without a payload on top ends it too
        if newest is None:
            return self.version
        reader.last_id, first = "0-0", True
        while _id(reader.last_id) < _id(newest):
            events = await reader.read_events(WeightsPublished, count=PAGE)
            if first and events:
                self.version, first = max(0, events[0].version), False
            self.take_all(events)
        return self.version


def _id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
