"""The finance domain (entry point ``finance = "domains.finance:Finance"``)."""

from domains.finance.domain import Finance, FinanceItem, Row, check, parse_answer

__all__ = ["Finance", "FinanceItem", "Row", "check", "parse_answer"]
