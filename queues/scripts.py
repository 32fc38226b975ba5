"""The Lua scripts of this package, read once: ``lua("handoff.lua")``. A script that
compares stream ids is given the helpers of ``ids.lua`` in front (``parse``, ``less``), so
they are written once."""

from __future__ import annotations

from importlib import resources

_WITH_IDS = {"trim.lua", "repair_lag.lua", "queued.lua"}


def _read(name: str) -> str:
    return resources.files("streamrl.queues").joinpath(name).read_text()


def lua(name: str) -> str:
    """The source of the script ``name`` (a file of this package), ready to register."""
    return (_read("ids.lua") + _read(name)) if name in _WITH_IDS else _read(name)
