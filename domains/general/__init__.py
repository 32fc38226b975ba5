"""The general-capability eval set (entry point ``general = "streamrl.domains.general:General"``);
see :mod:`domains.general.domain`."""

from streamrl.domains.general.domain import General, GeneralItem, extract_reply, normalize

__all__ = ["General", "GeneralItem", "extract_reply", "normalize"]
