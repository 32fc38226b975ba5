"""Domains by name.

Built-in domains register themselves with :func:`register` when their module is imported;
:func:`get_domain` imports the built-ins on first use. Third-party domains will be found
through the entry-point group ``streamrl.domains`` (``name = "package.module:factory"``);
that lookup is already wired here, after the built-ins.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable
from typing import Any, TypeVar

from domains.base import Domain

ENTRY_POINT_GROUP = "streamrl.domains"
BUILTIN_MODULES = ("domains.arith",)

_factories: dict[str, Callable[[], Domain]] = {}
_instances: dict[str, Domain] = {}

F = TypeVar("F", bound=Callable[[], Any])


def register(name: str) -> Callable[[F], F]:
    """Class or factory decorator: ``@register("arith") class Arith: ...``."""

    def decorate(factory: F) -> F:
        if name in _factories and _factories[name] is not factory:
            raise ValueError(f"domain {name!r} is already registered")
        _factories[name] = factory
        return factory

    return decorate


def _load_builtins() -> None:
    for module in BUILTIN_MODULES:
        importlib.import_module(module)


def _load_entry_point(name: str) -> None:
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            _factories.setdefault(name, ep.load())
            return


def get_domain(name: str) -> Domain:
    """The (shared) instance of the domain called ``name``; ``KeyError`` if unknown."""
    if name not in _instances:
        if name not in _factories:
            _load_builtins()
        if name not in _factories:
            _load_entry_point(name)
        if name not in _factories:
            raise KeyError(f"unknown domain {name!r}; known: {sorted(available())}")
        _instances[name] = _factories[name]()
    return _instances[name]


def available() -> list[str]:
    _load_builtins()
    return sorted(_factories)
