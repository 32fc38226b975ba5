"""A repository task's own image (``extra["image"]``) on the Docker backend: the executor's
sessions and one-shot runs for that item come from it, the other items' from the domain's
image; the process backend (no images) ignores it. A real engine, an image built here
``FROM`` the sandbox image with a marker file (offline)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from streamrl.actors.executor import Sandboxes
from streamrl.config.schema import DomainConfig, PromptConfig, SplitConfig, ToolsConfig
from streamrl.domains import registry
from streamrl.domains.base import item_image, write_jsonl
from streamrl.domains.declared import ENV, declare_domains
from streamrl.domains.repo.generate import instance
from streamrl.domains.repo.templates import STRINGS
from streamrl.sandbox import ExecRequest, Limits
from tests.actors.test_repo_tools import ROWS
from tests.sandbox.docker_engine import IMAGE, require_docker

ALT = "streamrl-test-item-image:1"
NAME = "repo_image_test"
MARKER = "/etc/streamrl-item-image"
CAT = ExecRequest(["sh", "-c", f"cat {MARKER} 2>/dev/null || echo none"],
                  limits=Limits(timeout_s=30))


@pytest.fixture(scope="module")
def alt_image(tmp_path_factory: pytest.TempPathFactory) -> str:
    require_docker("per-item images")
    context = tmp_path_factory.mktemp("alt-image")
    (context / "marker").write_text("item-image\n")
    (context / "Dockerfile").write_text(f"FROM {IMAGE}\nCOPY marker {MARKER}\n")
    subprocess.run(["docker", "build", "-q", "-t", ALT, str(context)], check=True,
                   capture_output=True, timeout=300)
    return ALT


@pytest.fixture
def domain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, alt_image: str) -> Iterator[str]:
    other = instance(STRINGS, STRINGS.bugs[-1], "plainpkg", 2)
    write_jsonl([{**ROWS[0], "image": alt_image}, other], tmp_path / "train.jsonl")
    write_jsonl(ROWS[1:], tmp_path / "eval.jsonl")
    monkeypatch.delenv(ENV, raising=False)
    declare_domains({NAME: DomainConfig(
        kind="repo_tests", data=str(tmp_path), tools=ToolsConfig(enabled=True),
        split=SplitConfig(by="files", train="train.jsonl", eval="eval.jsonl"),
        prompt=PromptConfig(template="{problem_statement}"))})
    yield NAME
    registry._factories.pop(NAME, None)
    registry._instances.pop(NAME, None)


async def test_an_items_image_backs_its_sessions_and_runs(domain: str) -> None:
    d = registry.get_domain(domain)
    items = d.load_items("train")
    with_image = next(i for i in items if i.extra.get("image"))
    without = next(i for i in items if not i.extra.get("image"))
    assert item_image(d, with_image) == ALT and item_image(d, without) == ""
    sandboxes = Sandboxes("docker", pool_size=1)
    async with sandboxes.opened():
        async with sandboxes.session(d, "img", item_image(d, with_image)) as session:
            assert (await session.run(CAT)).stdout == b"item-image\n"
        async with sandboxes.session(d, "plain", item_image(d, without)) as session:
            assert (await session.run(CAT)).stdout == b"none\n"
        ran = await sandboxes.run(d, CAT, "one-shot", item_image(d, with_image))
        assert ran.stdout == b"item-image\n"
    # the process backend has no images: the item's is not used there
    assert Sandboxes("process").choose(d, CAT, ALT)[1] == ""
