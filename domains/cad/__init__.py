"""The cad domain (entry point ``cad = "domains.cad:Cad"``); see :mod:`domains.cad.domain`."""

from domains.cad.domain import CONSTRAINTS, Cad, CadItem, constraints, read_verdict

__all__ = ["CONSTRAINTS", "Cad", "CadItem", "constraints", "read_verdict"]
