"""Tools for agentic sandbox domains: the standard tool set (``standard.py``) acting on an
episode's sandbox session, and pytest's per-test results (``pytest_report.py``). Tool
declaration, rendering and parsing are model-format code: ``inference/chat.py``."""
