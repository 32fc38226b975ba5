"""Only ``repo_tests`` domains can be agent-driven (issue 32, item 7): any other domain with an
``agent.command`` is refused when it is built (``up`` builds every domain at start) with
a message that says so."""

from __future__ import annotations

import pytest

from streamrl.config.schema import AgentConfig, DomainConfig, ToolsConfig
from streamrl.domains.declared import DeclarationError, build_domain


@pytest.mark.parametrize("name", ["arith", "math"])
def test_an_agent_on_a_domain_other_than_repo_tests_is_refused_clearly(name: str) -> None:
    cfg = DomainConfig(tools=ToolsConfig(enabled=True), agent=AgentConfig(command=["agent"]))
    with pytest.raises(DeclarationError) as info:
        build_domain(name, cfg)
    message = str(info.value)
    assert "agent" in message and "repo_tests" in message, message
