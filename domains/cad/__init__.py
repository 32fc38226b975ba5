"""The cad domain (entry point ``cad = "streamrl.domains.cad:Cad"``);
see :mod:`streamrl.domains.cad.domain`."""

from streamrl.domains.cad.domain import CONSTRAINTS, Cad, CadItem, constraints, read_verdict

__all__ = ["CONSTRAINTS", "Cad", "CadItem", "constraints", "read_verdict"]
