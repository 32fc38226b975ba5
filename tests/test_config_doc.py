"""docs/configuration.md is generated from the typed config and must be current."""

from pathlib import Path

import msgspec

from streamrl.cli.main import main
from streamrl.config import schema as C
from streamrl.config.doc import render

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_committed_reference_is_current() -> None:
    assert DOC.read_text() == render(), (
        "docs/configuration.md is stale: run `streamrl config-doc > docs/configuration.md`"
    )


def test_every_section_and_field_is_documented() -> None:
    text = render()
    sections = [f.name for f in msgspec.structs.fields(C.Config)]
    for name in sections:
        assert f"## `[{name}" in text, name
    # every field of every section has a row with its default
    for cls in (C.RunConfig, C.QueueConfig, C.LearnerConfig, C.DomainConfig, C.ExecutorConfig):
        for field in msgspec.structs.fields(cls):
            assert f"| `{field.name}` |" in text, f"{cls.__name__}.{field.name}"
    assert "## `[domain.<name>]`" in text
    assert "## `[executor.domains.<name>]`" in text
    assert "| `lr` | float > 0 | `1e-05` | AdamW learning rate. |" in text


def test_cli_prints_it(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["config-doc"]) == 0
    assert capsys.readouterr().out == render()
