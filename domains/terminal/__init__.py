"""The terminal domain (entry point ``terminal = "streamrl.domains.terminal:Terminal"``); see
:mod:`domains.terminal.domain`."""

from streamrl.domains.terminal.domain import Terminal, TerminalItem, extract_command, nonce

__all__ = ["Terminal", "TerminalItem", "extract_command", "nonce"]
