"""The finance domain (entry point ``finance = "streamrl.domains.finance:Finance"``)."""

from streamrl.domains.finance.domain import Finance, FinanceItem, Row, check, parse_answer

__all__ = ["Finance", "FinanceItem", "Row", "check", "parse_answer"]
