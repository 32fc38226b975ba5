"""The restricting Docker socket proxy (sandbox/socket_proxy.py) in front of the real engine.

Allowed: everything the Docker backend does (create with its hardening, attach, start, kill,
update, rename, inspect, delete, list by label) works through the proxy. Refused with 403,
never reaching the engine: privileged, host binds, cap-add, host network, exec, other
containers, unlabelled listing, build, info. Skips without an engine or the sandbox image
unless $CI is set (then it fails).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from streamrl.sandbox import ExecRequest, Limits
from streamrl.sandbox.docker import DockerSandbox, open_docker_sandbox
from streamrl.sandbox.socket_proxy import Policy, Proxy, serve_proxy
from tests.sandbox.docker_engine import IMAGE, SOCKET, require_docker


@pytest.fixture(scope="module")
def engine() -> str:
    require_docker("the socket proxy test")
    return SOCKET


@pytest.fixture
async def proxy(engine: str, tmp_path: Path) -> AsyncIterator[tuple[str, Proxy]]:
    path = str(tmp_path / "docker.sock")
    p = Proxy(engine, Policy())
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_proxy, f"unix:{path}", p)
        yield path, p
        nursery.cancel_scope.cancel()


def _engine() -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=SOCKET), base_url="http://d")


def _through(path: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=path), base_url="http://d")


def hardened(**host: Any) -> dict[str, Any]:
    """The create body of the Docker backend, with ``host`` merged into HostConfig."""
    body = DockerSandbox(IMAGE)._config(IMAGE)
    body["HostConfig"].update(host)
    return body


async def test_the_docker_backend_works_through_the_proxy(proxy: tuple[str, Proxy]) -> None:
    path, p = proxy
    # Given a Docker sandbox that knows only the proxy's socket
    url = f"unix://{path}"
    async with open_docker_sandbox(IMAGE, pool_size=1, host_grace_s=1.0, docker_url=url) as box:
        # When it runs code in a session (create, attach, start, update, rename, inspect)
        async with box.session(Limits(memory_mb=96, max_processes=16), label="proxied") as s:
            result = await s.run(ExecRequest(["python3", "-c", "print(6 * 7)"]))
        plain = await box.run(ExecRequest(["/bin/sh", "-c", "exit 3"]))
        orphans = await box.reap_orphans()  # lists by label
    # Then everything worked and nothing was refused
    assert (result.exit_code, result.stdout) == (0, b"42\n")
    assert plain.exit_code == 3
    assert orphans == []
    assert p.counts["refused"] == 0 and p.counts["allowed"] > 5
    async with _engine() as engine:
        mine = json.dumps({"label": [f"streamrl.instance={box.instance}"]})
        left = await engine.get("/containers/json", params={"all": "1", "filters": mine})
    assert left.json() == []


@pytest.mark.parametrize(
    ("what", "body"),
    [
        ("privileged", hardened(Privileged=True)),
        ("host bind", hardened(Binds=["/:/host"])),
        ("bind mount", hardened(Mounts=[{"Type": "bind", "Source": "/", "Target": "/h"}])),
        ("cap-add", hardened(CapAdd=["SYS_ADMIN"])),
        ("host network", hardened(NetworkMode="host")),
        ("bridge network", hardened(NetworkMode="bridge")),
        ("host pid", hardened(PidMode="host")),
        ("unconfined seccomp", hardened(SecurityOpt=["no-new-privileges:true",
                                                     "seccomp=unconfined"])),
        ("writable root", hardened(ReadonlyRootfs=False)),
        ("devices", hardened(Devices=[{"PathOnHost": "/dev/mem", "PathInContainer": "/dev/m"}])),
        ("root user", {**hardened(), "User": "0:0"}),
        ("no label", {**hardened(), "Labels": {}}),
        ("no memory limit", hardened(Memory=0)),
    ],
)
async def test_a_dangerous_create_is_refused(
    proxy: tuple[str, Proxy], what: str, body: dict[str, Any]
) -> None:
    path, _ = proxy
    name = f"streamrl-proxytest-{what.replace(' ', '-')}"
    async with _through(path) as client:
        response = await client.post("/v1.41/containers/create", params={"name": name}, json=body)
    assert response.status_code == 403, (what, response.text)
    assert "streamrl docker proxy" in response.json()["message"]
    async with _engine() as engine:
        assert (await engine.get(f"/containers/{name}/json")).status_code == 404  # never made


async def test_calls_the_backend_never_makes_are_refused(proxy: tuple[str, Proxy]) -> None:
    path, p = proxy
    async with _engine() as engine:
        # a container that is not a sandbox (created straight at the engine, never started)
        made = await engine.post(
            "/containers/create",
            params={"name": "proxytest-not-a-sandbox"},
            json={"Image": IMAGE, "Cmd": ["true"], "HostConfig": {"NetworkMode": "none"}},
        )
        assert made.status_code == 201, made.text
        other = made.json()["Id"]
        try:
            async with _through(path) as client:
                refused = [
                    await client.get("/info"),
                    await client.get("/containers/json", params={"all": "1"}),
                    await client.get("/images/json"),
                    await client.post("/build"),
                    await client.post("/images/create", params={"fromImage": "busybox"}),
                    await client.post(f"/containers/{other}/start"),
                    await client.get(f"/containers/{other}/json"),
                    await client.delete(f"/containers/{other}", params={"force": "1"}),
                    await client.post(f"/containers/{other}/exec", json={"Cmd": ["id"]}),
                    await client.get(f"/containers/{other}/archive", params={"path": "/"}),
                    await client.post("/volumes/create", json={"Name": "x"}),
                    await client.post("/networks/create", json={"Name": "x"}),
                ]
                allowed = await client.get("/_ping")
            assert [r.status_code for r in refused] == [403] * len(refused)
            assert allowed.status_code == 200
            state = (await engine.get(f"/containers/{other}/json")).json()["State"]
            assert state["Status"] == "created"  # the refused start never reached the engine
        finally:
            await engine.delete(f"/containers/{other}", params={"force": "1"})
    assert p.counts["refused"] == 12


async def test_exec_and_escalating_updates_on_a_sandbox_are_refused(
    proxy: tuple[str, Proxy],
) -> None:
    path, _ = proxy
    url = f"unix://{path}"
    async with (
        open_docker_sandbox(IMAGE, pool_size=1, host_grace_s=1.0, docker_url=url) as box,
        box.session(Limits(), label="exec-target") as s,
    ):
        await s.run(ExecRequest(["true"]))
        name = s._live_box().name  # type: ignore[attr-defined]
        async with _through(path) as client:
            exec_ = await client.post(
                f"/containers/{name}/exec",
                json={"Cmd": ["id"], "User": "root", "Privileged": True},
            )
            unlimited = await client.post(f"/containers/{name}/update", json={"Memory": -1})
            restart = await client.post(
                f"/containers/{name}/update", json={"RestartPolicy": {"Name": "always"}}
            )
            rename = await client.post(f"/containers/{name}/rename", params={"name": "x"})
            inspect = await client.get(f"/containers/{name}/json")
    assert [exec_.status_code, unlimited.status_code, restart.status_code,
            rename.status_code] == [403] * 4  # fmt: skip
    assert inspect.status_code == 200  # a sandbox may be inspected
