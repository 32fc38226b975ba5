"""Domains by name, found through the ``streamrl.domains`` entry-point group.

Every domain, built-in or third-party, is declared the same way, in its package's metadata::

    [project.entry-points."streamrl.domains"]
    math = "streamrl.domains.math:Math"          # name = "module:factory" (a class or a function)

:func:`get_domain` looks the name up in that group (``importlib.metadata``; after editing
entry points, reinstall: ``pip install --no-deps -e .``), calls the factory once per process
and keeps the instance. :func:`register` adds a factory in-process (tests, generated
domains in benchmarks); an in-process registration wins over an entry point of the same
name. :func:`declare` registers the domains declared as data in TOML (``[domain.<name>]``
with a ``kind``). Nothing else in the code base names a domain: adding one touches no actor
code.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from typing import Any, TypeVar

from streamrl.domains.base import Domain

ENTRY_POINT_GROUP = "streamrl.domains"

_factories: dict[str, Callable[[], Domain]] = {}
_instances: dict[str, Domain] = {}
_resolvers: list[Callable[[str], bool]] = []
"""Asked, in order, for a name nothing registered: each may register it (True) or not."""

F = TypeVar("F", bound=Callable[[], Any])


def register(name: str) -> Callable[[F], F]:
    """Class or factory decorator: ``@register("mine") class Mine: ...`` (in-process)."""

    def decorate(factory: F) -> F:
        if name in _factories and _factories[name] is not factory:
            raise ValueError(f"domain {name!r} is already registered")
        _factories[name] = factory
        return factory

    return decorate


def declare(name: str, factory: Callable[[], Domain]) -> None:
    """Register a declared domain's factory (:mod:`streamrl.domains.declared`). Declaring the
    same name again with an equal declaration keeps the instance; another one replaces it."""
    old = _factories.get(name)
    same = getattr(old, "declaration", None)
    if old is not None and same is not None and same == getattr(factory, "declaration", None):
        return
    _factories[name] = factory
    _instances.pop(name, None)


def add_resolver(resolve: Callable[[str], bool]) -> None:
    """Ask ``resolve(name)`` for a domain nothing registered (e.g. a declared domain in a
    process that did not read the config itself: domains/declared.py)."""
    if resolve not in _resolvers:
        _resolvers.append(resolve)


def entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def get_domain(name: str) -> Domain:
    """The (shared) instance of the domain called ``name``; ``KeyError`` if unknown."""
    if name not in _instances:
        factory = _factories.get(name)
        if factory is None and any(resolve(name) for resolve in _resolvers):
            factory = _factories.get(name)
        if factory is None:
            ep = entry_points().get(name)
            if ep is None:
                raise KeyError(f"unknown domain {name!r}; known: {available()}")
            factory = ep.load()
            _factories.setdefault(name, factory)
        _instances[name] = factory()
    return _instances[name]


def available() -> list[str]:
    return sorted(set(_factories) | set(entry_points()))
