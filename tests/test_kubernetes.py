"""deploy/kubernetes: the shipped manifests pass `make k8s-check` (deploy/kubernetes/check.py),
the base and the vLLM overlay (overlays/vllm); the checker renders them as kustomize would and
fails, naming the problem, on each kind of mistake it claims to catch; the vLLM servers run
with what `streamrl up` starts vLLM with; and Redis's start-up script keeps the role users
across a restart of a real server."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis
import yaml

from streamrl.inference import vllm_server
from streamrl.net import free_port
from streamrl.testing.wait import wait_until_sync
from tests.helpers import redis_server_for_tests

REPO = Path(__file__).resolve().parents[1]
KUBE = REPO / "deploy" / "kubernetes"
VLLM = KUBE / "overlays" / "vllm"

Docs = list[dict[str, Any]]


@pytest.fixture(scope="module")
def k8s() -> ModuleType:
    spec = importlib.util.spec_from_file_location("k8s_check", KUBE / "check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["k8s_check"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """A copy of deploy/kubernetes to break."""
    shutil.copytree(KUBE, tmp_path / "kubernetes", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path / "kubernetes"


def edit(directory: Path, name: str, change: Callable[[Docs], None]) -> None:
    path = directory / name
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    change(docs)
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))


def doc(docs: Docs, kind: str, name: str) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def container(docs: Docs, kind: str, name: str) -> dict[str, Any]:
    spec = doc(docs, kind, name)["spec"]
    return spec["template"]["spec"]["containers"][0]


def trigger(docs: Docs, name: str) -> dict[str, Any]:
    """The metadata of the first trigger of ScaledObject ``name``."""
    return doc(docs, "ScaledObject", name)["spec"]["triggers"][0]["metadata"]


def test_the_shipped_manifests_pass(k8s: ModuleType) -> None:
    # When the base is checked, alone and with the archiver component
    for components in ([], [KUBE / "components" / "archiver"]):
        report = k8s.check(KUBE, components)
        # Then nothing is wrong, and everything the docs promise is in the render
        assert report.problems == []
        kinds = {(r["kind"], r["metadata"]["name"]) for r in report.resources}
        for name in ("scheduler", "generator", "executor", "verifier", "sglang-router"):
            assert ("Deployment", name) in kinds
        for name in ("redis", "sglang", "learner"):
            assert ("StatefulSet", name) in kinds
        for name in ("generator", "executor", "verifier"):
            assert ("ScaledObject", name) in kinds
        assert ("Job", "streamrl-acl") in kinds
        assert (("Deployment", "archiver") in kinds) == bool(components)


def test_the_command_line_exits_0_on_the_base_and_1_on_a_broken_copy(k8s: ModuleType,
                                                                       copy: Path) -> None:
    script = [sys.executable, str(KUBE / "check.py")]
    ok = subprocess.run(script, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "valid against Kubernetes 1.30 (strict)" in ok.stdout
    edit(copy, "keda.yaml", lambda d: trigger(d, "verifier").update(consumerGroup="verifiers"))
    broken = subprocess.run([*script, str(copy)], capture_output=True, text=True, timeout=120)
    assert broken.returncode == 1
    assert "ScaledObject/verifier: triggers.0: consumerGroup 'verifiers'" in broken.stderr
    printed = subprocess.run([*script, "--print"], capture_output=True, text=True, timeout=120)
    assert printed.returncode == 0
    assert list(yaml.safe_load_all(printed.stdout)) == k8s.render(KUBE)


def test_render_applies_namespace_labels_images_and_generators(k8s: ModuleType,
                                                                copy: Path) -> None:
    # Given an overlay-style edit: another namespace and a registry for the project image
    k = yaml.safe_load((copy / "kustomization.yaml").read_text())
    k["namespace"] = "rl"
    k["images"][0] = {"name": "streamrl", "newName": "registry.example.com:5000/ml/streamrl",
                      "newTag": "0.1.0"}
    (copy / "kustomization.yaml").write_text(yaml.safe_dump(k))
    # When it is rendered
    resources = k8s.render(copy)
    # Then every namespaced resource is in it, the Namespace is renamed, cluster-wide none
    namespace = doc(resources, "Namespace", "rl")
    assert "namespace" not in namespace["metadata"]
    assert {r["metadata"].get("namespace") for r in resources if r["kind"] != "Namespace"} == \
        {"rl"}
    # the common label is on every resource and pod template, never on a selector
    for r in resources:
        assert r["metadata"]["labels"]["app.kubernetes.io/part-of"] == "streamrl"
        if r["kind"] in ("Deployment", "StatefulSet", "Job"):
            assert r["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/part-of"] == \
                "streamrl"
            assert "app.kubernetes.io/part-of" not in r["spec"].get("selector", {}).get(
                "matchLabels", {})
    # the image override reaches the streamrl image only, not streamrl-cuda
    images = {c["image"] for r in resources for c in k8s.containers(r)}
    assert "registry.example.com:5000/ml/streamrl:0.1.0" in images
    assert "streamrl-cuda:latest" in images and "streamrl:latest" not in images
    # and the generated ConfigMaps hold the TOML file and the literal, unhashed names
    config = doc(resources, "ConfigMap", "streamrl-config")
    assert config["data"]["streamrl.toml"] == (copy / "streamrl.toml").read_text()
    assert doc(resources, "ConfigMap", "streamrl-redis")["data"] == {
        "STREAMRL_REDIS_URL": "redis://redis:6379/0"}
    # The namespace is also in the KEDA triggers' address: the check says they now disagree
    problems = k8s.check(copy).problems
    assert any("address 'redis.streamrl.svc.cluster.local:6379' is not the actors' Redis"
               in p for p in problems), problems


def test_split_image(k8s: ModuleType) -> None:
    assert k8s.split_image("streamrl:latest") == ("streamrl", "latest", "")
    assert k8s.split_image("host:5000/a/b") == ("host:5000/a/b", "", "")
    assert k8s.split_image("host:5000/a/b:1@sha256:ab") == ("host:5000/a/b", "1", "sha256:ab")


def _set_toml(directory: Path, old: str, new: str) -> None:
    path = directory / "streamrl.toml"
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


def _kustomization(field: str, value: Any) -> Callable[[Path], None]:
    def change(directory: Path) -> None:
        k = yaml.safe_load((directory / "kustomization.yaml").read_text())
        k[field] = value
        (directory / "kustomization.yaml").write_text(yaml.safe_dump(k))
    return change


def _yaml(name: str, change: Callable[[Docs], None]) -> Callable[[Path], None]:
    return lambda directory: edit(directory, name, change)


def _learner_nproc(docs: Docs) -> None:
    args = container(docs, "StatefulSet", "learner")["args"]
    args[args.index("--nproc-per-node=2")] = "--nproc-per-node=4"


def _extra_password(docs: Docs) -> None:
    env = container(docs, "Deployment", "executor")["env"]
    env.append({"name": "STREAMRL_PASSWORD_LEARNER", "valueFrom": {"secretKeyRef": {
        "name": "streamrl-passwords", "key": "STREAMRL_PASSWORD_LEARNER"}}})


def _no_gpu(docs: Docs) -> None:
    for section in ("requests", "limits"):
        del container(docs, "StatefulSet", "sglang")["resources"][section]["nvidia.com/gpu"]


def _lag_mode(docs: Docs) -> None:
    meta = trigger(docs, "verifier")
    del meta["pendingEntriesCount"]
    meta["lagCount"] = "4"


def _router_workers(docs: Docs) -> None:
    args = container(docs, "Deployment", "sglang-router")["args"]
    args.append("http://sglang-1.sglang:30000")


BREAKAGES: list[tuple[str, Callable[[Path], None], str]] = [
    ("unknown field in a Deployment",
     _yaml("generator.yaml", lambda d: container(d, "Deployment", "generator").update(bogus=1)),
     "Deployment/generator: spec.template.spec.containers.0: Additional properties are not "
     "allowed ('bogus' was unexpected) (Kubernetes 1.30)"),
    ("ScaledObject on a missing Deployment",
     _yaml("keda.yaml", lambda d: doc(d, "ScaledObject", "executor")["spec"][
         "scaleTargetRef"].update(name="executors")),
     "ScaledObject/executor: scaleTargetRef names Deployment 'executors', not in the render"),
    ("wrong consumer group",
     _yaml("keda.yaml", lambda d: trigger(d, "generator").update(consumerGroup="generators")),
     "ScaledObject/generator: triggers.0: consumerGroup 'generators': the generators read "
     "streamrl:{k8s}:s:tasks in group 'generator'"),
    ("another stage's stream",
     _yaml("keda.yaml", lambda d: trigger(d, "executor").update(
         stream="streamrl:{k8s}:s:executed")),
     "ScaledObject/executor: triggers.0: stream 'streamrl:{k8s}:s:executed': the executors of "
     "run 'k8s' read ['streamrl:{k8s}:s:rollouts'] (protocol/names.py)"),
    ("run renamed in the TOML only",
     lambda d: _set_toml(d, 'name = "k8s"', 'name = "other"'),
     "ScaledObject/verifier: triggers.0: stream 'streamrl:{k8s}:s:executed': the verifiers of "
     "run 'other' read ['streamrl:{other}:s:executed']"),
    ("a sharded run with one trigger per stage",
     lambda d: _set_toml(d, "[queues]\n", "[queues]\nshards = 2\n"),
     "ScaledObject/generator: no trigger on ['streamrl:{k8s.s0}:s:tasks', "
     "'streamrl:{k8s.s1}:s:tasks']"),
    ("KEDA user without XPENDING",
     _yaml("keda.yaml", lambda d: trigger(d, "verifier").update(
         username="streamrl-k8s-scheduler")),
     "user streamrl-k8s-scheduler (scheduler) may not send XPENDING on "
     "streamrl:{k8s}:s:executed"),
    ("lag mode: INFO is no role's",
     _yaml("keda.yaml", _lag_mode),
     "user streamrl-k8s-autoscaler (autoscaler) may not send INFO"),
    ("KEDA as the operator's admin",
     _yaml("keda.yaml", lambda d: trigger(d, "generator").update(username="streamrl-k8s-admin")),
     "user streamrl-k8s-admin (admin) may do more than KEDA needs: connect as "
     "streamrl-k8s-autoscaler"),
    ("threshold at the stage's concurrency",
     _yaml("keda.yaml", lambda d: trigger(d, "executor").update(pendingEntriesCount="8")),
     "pendingEntriesCount 8 >= executor.concurrency 8: a replica never holds more than 8"),
    ("a number where KEDA wants a string",
     _yaml("keda.yaml", lambda d: trigger(d, "executor").update(pendingEntriesCount=6)),
     "ScaledObject/executor: spec.triggers.0.metadata.pendingEntriesCount: 6 is not of type "
     "'string' (KEDA schema)"),
    ("a password in trigger metadata",
     _yaml("keda.yaml", lambda d: trigger(d, "executor").update(password="x")),
     "('password' was unexpected) (KEDA schema)"),
    ("replicas on a KEDA-scaled Deployment",
     _yaml("generator.yaml", lambda d: doc(d, "Deployment", "generator")["spec"].update(
         replicas=2)),
     "ScaledObject/generator: Deployment/generator sets spec.replicas"),
    ("not an actor",
     _yaml("verifier.yaml", lambda d: container(d, "Deployment", "verifier")["args"].__setitem__(
         1, "monitor")),
     "runs streamrl run monitor --config /etc/streamrl/streamrl.toml: neither `streamrl run "
     "<scheduler|generator|executor|verifier|learner|archiver>`"),
    ("another role's password",
     _yaml("executor.yaml", _extra_password),
     "Deployment/executor (executor): holds ['STREAMRL_PASSWORD_EXECUTOR', "
     "'STREAMRL_PASSWORD_LEARNER']: an actor holds its own role's password"),
    ("a secret key the template lacks",
     _yaml("secrets.example.yaml", lambda d: doc(d, "Secret", "streamrl-passwords")[
         "stringData"].pop("STREAMRL_PASSWORD_AUTOSCALER")),
     "TriggerAuthentication/streamrl-redis-autoscaler: Secret 'streamrl-passwords' has no key "
     "'STREAMRL_PASSWORD_AUTOSCALER'"),
    ("a ConfigMap nobody generates",
     _yaml("scheduler.yaml", lambda d: container(d, "Deployment", "scheduler")["env"][0][
         "valueFrom"]["configMapKeyRef"].update(name="redis-url")),
     "Deployment/scheduler: ConfigMap 'redis-url' is not in the render"),
    ("more ranks than GPUs",
     _yaml("learner.yaml", _learner_nproc),
     "StatefulSet/learner (learner): learner.device = 'cuda' with 4 rank(s) on 2 GPU(s)"),
    ("an SGLang server without a GPU",
     _yaml("sglang.yaml", _no_gpu),
     "StatefulSet/sglang (sglang): an SGLang server needs nvidia.com/gpu limits"),
    ("router and generator disagree on the servers",
     _yaml("sglang.yaml", _router_workers),
     "sglang-router --worker-urls ['http://sglang-0.sglang:30000', "
     "'http://sglang-1.sglang:30000'] differ from generator.server_urls"),
    ("a server URL with no pod behind it",
     lambda d: _set_toml(d, '"http://sglang-0.sglang:30000"]', '"http://sglang-1.sglang:30000"]'),
     "http://sglang-1.sglang:30000: StatefulSet/sglang has no pod sglang-1"),
    ("SGLang reads the weights from another volume",
     _yaml("sglang.yaml", lambda d: doc(d, "StatefulSet", "sglang")["spec"]["template"]["spec"][
         "volumes"][1]["persistentVolumeClaim"].update(claimName="streamrl-models")),
     "mount claim streamrl-data at /data as the learner does"),
    ("executor without an unmasked /proc",
     _yaml("executor.yaml", lambda d: container(d, "Deployment", "executor")[
         "securityContext"].pop("procMount")),
     "bwrap sandboxes (executor.backend 'process') need procMount: Unmasked"),
    ("min_isolation the backend cannot reach",
     lambda d: _set_toml(d, 'min_isolation = "bwrap"', 'min_isolation = "docker"'),
     "executor.min_isolation 'docker' with the process backend at 'bwrap'"),
    ("no time to drain",
     _yaml("verifier.yaml", lambda d: doc(d, "Deployment", "verifier")["spec"]["template"][
         "spec"].update(terminationGracePeriodSeconds=30)),
     "terminationGracePeriodSeconds 30: an actor drains for up to 60 s"),
    ("the ACL Job's admin URL names another Redis",
     _yaml("secrets.example.yaml", lambda d: doc(d, "Secret", "streamrl-redis")[
         "stringData"].update({"admin-url": "redis://:x@redis-old:6379/0"})),
     "Job/streamrl-acl (acl): its admin URL names another Redis than the actors' "
     "redis://redis:6379/0"),
    ("an external Redis the triggers do not follow",
     _kustomization("configMapGenerator", [
         {"name": "streamrl-config", "files": ["streamrl.toml"]},
         {"name": "streamrl-redis",
          "literals": ["STREAMRL_REDIS_URL=rediss://redis.example.com:6380/0"]}]),
     "ScaledObject/executor: triggers.0: address 'redis.streamrl.svc.cluster.local:6379' is "
     "not the actors' Redis (rediss://redis.example.com:6380/0)"),
    ("a config the schema refuses",
     lambda d: _set_toml(d, "concurrency = 64", "concurrency = 0"),
     "ConfigMap/streamrl-config streamrl.toml: Expected `int` >= 1"),
]


def _external(directory: Path, url: str, trigger_type: str, addresses: dict[str, str]) -> None:
    """docs/kubernetes.md, "An external Redis", step by step."""
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    k["resources"].remove("redis.yaml")
    k["configMapGenerator"][1]["literals"] = [f"STREAMRL_REDIS_URL={url}"]
    (directory / "kustomization.yaml").write_text(yaml.safe_dump(k))
    edit(directory, "secrets.example.yaml", lambda d: doc(d, "Secret", "streamrl-redis")[
        "stringData"].update({"admin-url": url.replace("//", "//admin:x@", 1)}))

    def triggers(docs: Docs) -> None:
        for so in (d for d in docs if d["kind"] == "ScaledObject"):
            t = so["spec"]["triggers"][0]
            t["type"] = trigger_type
            del t["metadata"]["address"]
            t["metadata"].update(addresses)
    edit(directory, "keda.yaml", triggers)


@pytest.mark.parametrize(("url", "trigger_type", "addresses"), [
    ("rediss://redis.example.com:6380/0", "redis-streams",
     {"address": "redis.example.com:6380", "enableTLS": "true"}),
    ("redis+cluster://node-1.example.com:6379,node-2.example.com:6379", "redis-cluster-streams",
     {"addresses": "node-1.example.com:6379,node-2.example.com:6379"}),
], ids=["tls", "cluster"])
def test_the_documented_external_redis_passes(k8s: ModuleType, copy: Path, url: str,
                                              trigger_type: str,
                                              addresses: dict[str, str]) -> None:
    # Given the base pointed at an external Redis as docs/kubernetes.md says
    _external(copy, url, trigger_type, addresses)
    # Then it checks clean, without the in-cluster Redis
    report = k8s.check(copy)
    assert report.problems == []
    assert "redis" not in {r["metadata"]["name"] for r in report.resources
                           if r["kind"] == "StatefulSet"}


def test_unimplemented_kustomize_fields_are_refused(k8s: ModuleType, copy: Path) -> None:
    _kustomization("replicas", [{"name": "generator", "count": 2}])(copy)
    assert k8s.check(copy).problems == [
        f"render: {copy / 'kustomization.yaml'}: ['replicas']: not implemented by check.py's "
        f"renderer"]


@pytest.mark.parametrize("patch", [
    {"patch": "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: verifier}\n"
              "spec: {replicas: 2}\n"},
    {"patch": '[{"op": "remove", "path": "/spec/replicas"}]'},
    {"path": "p.yaml", "target": {"kind": "Deployment"}},
], ids=["merge", "json6902", "target"])
def test_patches_other_than_deletions_are_refused(k8s: ModuleType, copy: Path,
                                                  patch: dict[str, Any]) -> None:
    (copy / "p.yaml").write_text("$patch: delete\napiVersion: apps/v1\nkind: Deployment\n"
                                 "metadata: {name: verifier}\n")
    _kustomization("patches", [patch])(copy)
    [problem] = k8s.check(copy).problems
    assert problem.startswith(f"render: {copy}: patches: "), problem


def test_render_deletes_and_replaces_from_an_overlay(k8s: ModuleType, tmp_path: Path) -> None:
    # Given an overlay of the base that deletes a resource and replaces or merges ConfigMaps
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "streamrl.toml").write_text("# replaced\n")
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [str(KUBE)],
        "patches": [{"patch": "$patch: delete\napiVersion: apps/v1\nkind: Deployment\n"
                              "metadata: {name: verifier}\n"}],
        "configMapGenerator": [
            {"name": "streamrl-config", "behavior": "replace", "files": ["streamrl.toml"]},
            {"name": "streamrl-redis", "behavior": "merge", "literals": ["EXTRA=1"]}],
        "generatorOptions": {"disableNameSuffixHash": True}}))
    # When it is rendered
    resources = k8s.render(overlay)
    base = k8s.render(KUBE)
    # Then the deleted one is gone and nothing else
    names = [(r["kind"], r["metadata"]["name"]) for r in resources]
    assert names == [(r["kind"], r["metadata"]["name"]) for r in base
                     if (r["kind"], r["metadata"]["name"]) != ("Deployment", "verifier")]
    # the replaced ConfigMap has the overlay's data and the base's namespace and labels, in
    # its place; the merged one both data
    config = doc(resources, "ConfigMap", "streamrl-config")
    assert config["data"] == {"streamrl.toml": "# replaced\n"}
    assert config["metadata"] == doc(base, "ConfigMap", "streamrl-config")["metadata"]
    assert doc(resources, "ConfigMap", "streamrl-redis")["data"] == {
        "STREAMRL_REDIS_URL": "redis://redis:6379/0", "EXTRA": "1"}
    # And a ConfigMap created twice, or replaced where there is none, is refused
    for generator, expected in [({"name": "streamrl-redis", "literals": ["A=1"]}, "exists"),
                                ({"name": "nowhere", "behavior": "replace", "literals": ["A=1"]},
                                 "0 ConfigMaps of that name to replace")]:
        (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
            "resources": [str(KUBE)], "configMapGenerator": [generator],
            "generatorOptions": {"disableNameSuffixHash": True}}))
        with pytest.raises(k8s.RenderError, match=expected):
            k8s.render(overlay)


# -- the vLLM overlay ---------------------------------------------------------------------------

def test_the_vllm_overlay_passes_and_swaps_sglang_for_vllm(k8s: ModuleType) -> None:
    # When the overlay is checked (as the command line would: its base's secrets template)
    report = k8s.check(VLLM)
    # Then nothing is wrong, the SGLang servers and router are gone and vLLM's are there
    assert report.problems == []
    kinds = {(r["kind"], r["metadata"]["name"]) for r in report.resources}
    assert {("StatefulSet", "vllm"), ("Service", "vllm")} <= kinds
    assert not {n for _, n in kinds if n.startswith("sglang")}
    base = k8s.render(KUBE)
    assert len(report.resources) == len(base) - 4 + 3   # + the extension's ConfigMap
    # the config every pod reads is the overlay's: engine vllm, one URL per server
    text = doc(report.resources, "ConfigMap", "streamrl-config")["data"]["streamrl.toml"]
    generator = tomllib.loads(text)["generator"]
    sts = doc(report.resources, "StatefulSet", "vllm")
    assert generator["engine"] == "vllm" and "router_url" not in generator
    assert generator["server_urls"] == [f"http://vllm-{i}.vllm:8000"
                                        for i in range(sts["spec"]["replicas"])]
    # the image is the vLLM version streamrl's client is tested with
    image = sts["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == f"vllm/vllm-openai:v{vllm_server.VLLM_VERSION}"


def test_the_vllm_overlay_config_is_the_base_config_but_the_generator() -> None:
    base = tomllib.loads((KUBE / "streamrl.toml").read_text())
    overlay = tomllib.loads((VLLM / "streamrl.toml").read_text())
    assert base.pop("generator")["engine"] == "sglang"
    assert overlay.pop("generator")["engine"] == "vllm"
    assert overlay == base


def test_the_vllm_servers_start_as_streamrl_up_starts_them(k8s: ModuleType,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # Given the overlay's vLLM container, and the command line `streamrl up` starts vLLM with
    resources = k8s.render(VLLM)
    c = doc(resources, "StatefulSet", "vllm")["spec"]["template"]["spec"]["containers"][0]
    monkeypatch.setattr(vllm_server, "vllm_executable", lambda: Path("vllm"))
    local = k8s._options(vllm_server.vllm_command("/models/m", 8000))
    # Then the container carries every flag of it that is not the machine's, and the env
    options = k8s._options([*c["command"], *c["args"]])
    missing = {f: v for f, v in local.items()
               if f not in vllm_server.MACHINE_FLAGS and options.get(f, "absent") != v}
    assert missing == {}, f"the vLLM StatefulSet lacks {missing}"
    env = {e["name"]: e["value"] for e in c["env"]}
    assert vllm_server.SERVER_ENVIRONMENT.items() <= env.items()
    # and the extension's ConfigMap is this checkout's file
    ext = doc(resources, "ConfigMap", "streamrl-vllm-ext")["data"]
    assert ext == {"streamrl_vllm_ext.py": (
        vllm_server.EXTENSION_DIR / "streamrl_vllm_ext.py").read_text()}


def _vllm_container(docs: Docs) -> dict[str, Any]:
    return container(docs, "StatefulSet", "vllm")


def _vllm_args(change: Callable[[list[str]], None]) -> Callable[[Path], None]:
    return _yaml("overlays/vllm/vllm.yaml", lambda d: change(_vllm_container(d)["args"]))


def _drop(flag: str) -> Callable[[list[str]], None]:
    def change(args: list[str]) -> None:
        i = args.index(flag)
        del args[i:i + (1 if i + 1 == len(args) or args[i + 1].startswith("--") else 2)]
    return change


def _set(flag: str, value: str) -> Callable[[list[str]], None]:
    return lambda args: args.__setitem__(args.index(flag) + 1, value)


def _vllm_toml(old: str, new: str) -> Callable[[Path], None]:
    return lambda d: _set_toml(d / "overlays" / "vllm", old, new)


def _no_env(name: str) -> Callable[[Docs], None]:
    def change(docs: Docs) -> None:
        env = _vllm_container(docs)["env"]
        env[:] = [e for e in env if e["name"] != name]
    return change


def _unmount(name: str) -> Callable[[Docs], None]:
    def change(docs: Docs) -> None:
        mounts = _vllm_container(docs)["volumeMounts"]
        mounts[:] = [m for m in mounts if m["name"] != name]
    return change


def _vllm_no_gpu(docs: Docs) -> None:
    for section in ("requests", "limits"):
        del _vllm_container(docs)["resources"][section]["nvidia.com/gpu"]


def _keep_sglang(directory: Path) -> None:
    (directory / "overlays" / "vllm" / "without-sglang.yaml").write_text(
        "$patch: delete\napiVersion: apps/v1\nkind: Deployment\nmetadata:\n"
        "  name: sglang-router\n")


VLLM_BREAKAGES: list[tuple[str, Callable[[Path], None], str]] = [
    ("no --logprobs-mode", _vllm_args(_drop("--logprobs-mode")),
     "StatefulSet/vllm (vllm): needs --logprobs-mode processed_logprobs (streamrl's vLLM "
     "client: inference/vllm_server.py, serve_flags)"),
    ("vLLM's default logprobs", _vllm_args(_set("--logprobs-mode", "raw_logprobs")),
     "needs --logprobs-mode processed_logprobs, not 'raw_logprobs'"),
    ("no token-in/token-out route", _vllm_args(_drop("--enable-scale-out")),
     "StatefulSet/vllm (vllm): needs --enable-scale-out"),
    ("no worker extension", _vllm_args(_drop("--worker-extension-cls")),
     "needs --worker-extension-cls streamrl_vllm_ext.WeightReload"),
    ("chunked prefill", _vllm_args(_drop("--no-enable-chunked-prefill")),
     "needs --no-enable-chunked-prefill"),
    ("a batch shorter than a sequence", _vllm_args(_set("--max-num-batched-tokens", "2048")),
     "--max-num-batched-tokens 2048 below --max-model-len 4096"),
    ("no --max-model-len", _vllm_args(_drop("--max-model-len")),
     "StatefulSet/vllm (vllm): no --max-model-len"),
    ("no dev mode", _yaml("overlays/vllm/vllm.yaml", _no_env("VLLM_SERVER_DEV_MODE")),
     "StatefulSet/vllm (vllm): VLLM_SERVER_DEV_MODE=None, needs '1'"),
    ("the extension not mounted", _yaml("overlays/vllm/vllm.yaml", _unmount("vllm-ext")),
     "no directory of PYTHONPATH '/opt/streamrl/vllm_ext' holds streamrl_vllm_ext.py from a "
     "ConfigMap"),
    ("a stale copy of the extension",
     lambda d: (d / "overlays" / "vllm" / "streamrl_vllm_ext.py").write_text("# old\n"),
     "ConfigMap/streamrl-vllm-ext streamrl_vllm_ext.py is not this checkout's"),
    ("more replicas than server_urls",
     _yaml("overlays/vllm/vllm.yaml", lambda d: doc(d, "StatefulSet", "vllm")["spec"].update(
         replicas=3)),
     "StatefulSet/vllm: vLLM server(s) ['vllm-2'] in no URL of generator.server_urls"),
    ("fewer replicas than server_urls",
     _yaml("overlays/vllm/vllm.yaml", lambda d: doc(d, "StatefulSet", "vllm")["spec"].update(
         replicas=1)),
     "http://vllm-1.vllm:8000: StatefulSet/vllm has no pod vllm-1"),
    ("a URL on another port",
     _vllm_toml('"http://vllm-1.vllm:8000"]', '"http://vllm-1.vllm:8001"]'),
     "http://vllm-1.vllm:8001: Service 'vllm' has no port 8001"),
    ("vLLM on another port than the Service's", _vllm_args(_set("--port", "8080")),
     "http://vllm-0.vllm:8000: Service 'vllm' sends port 8000 to 8000, and vLLM listens on "
     "8080 (--port)"),
    ("no server_urls", _vllm_toml(
        'server_urls = ["http://vllm-0.vllm:8000", "http://vllm-1.vllm:8000"]',
        'router_url = "http://vllm:8000"'),
     "engine 'vllm' needs server_urls naming every vLLM server"),
    ("a vLLM server without a GPU", _yaml("overlays/vllm/vllm.yaml", _vllm_no_gpu),
     "StatefulSet/vllm (vllm): a vLLM server needs nvidia.com/gpu limits 1 (its "
     "--tensor-parallel-size)"),
    ("vLLM reads the weights from another volume",
     _yaml("overlays/vllm/vllm.yaml", lambda d: doc(d, "StatefulSet", "vllm")["spec"][
         "template"]["spec"]["volumes"][1]["persistentVolumeClaim"].update(
         claimName="streamrl-models")),
     "StatefulSet/vllm (vllm): mount claim streamrl-data at /data as the learner does"),
    ("the engine left at sglang", _vllm_toml('engine = "vllm"', 'engine = "sglang"'),
     "StatefulSet/vllm (vllm): a vLLM server, but generator.engine is 'sglang'"),
    ("SGLang kept beside vLLM", _keep_sglang,
     "StatefulSet/sglang (sglang): an SGLang server, but generator.engine is 'vllm'"),
]


CHECKED = [("", b) for b in BREAKAGES] + [("overlays/vllm", b) for b in VLLM_BREAKAGES]


@pytest.mark.parametrize(("target", "change", "expected"),
                         [(t, c, e) for t, (_, c, e) in CHECKED],
                         ids=[name for _, (name, _, _) in CHECKED])
def test_the_check_names_each_mistake(k8s: ModuleType, copy: Path, target: str,
                                      change: Callable[[Path], None], expected: str) -> None:
    # Given a copy of the manifests (the base, or the base and the vLLM overlay) with one mistake
    change(copy)
    # When it (the base, or the overlay) is checked
    problems = k8s.check(copy / target if target else copy).problems
    # Then the check fails and says what is wrong
    assert any(expected in p for p in problems), "\n".join(problems)


def test_the_command_line_checks_the_vllm_overlay(copy: Path) -> None:
    script = [sys.executable, str(KUBE / "check.py")]
    ok = subprocess.run([*script, str(VLLM)], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    _vllm_args(_drop("--logprobs-mode"))(copy)
    broken = subprocess.run([*script, str(copy / "overlays" / "vllm")], capture_output=True,
                            text=True, timeout=120)
    assert broken.returncode == 1
    assert "needs --logprobs-mode processed_logprobs" in broken.stderr


# -- Redis's start-up script (redis.yaml) against a real server ---------------------------------

def _redis_script() -> str:
    docs = list(yaml.safe_load_all((KUBE / "redis.yaml").read_text()))
    args: list[str] = container(docs, "StatefulSet", "redis")["args"]
    return args[0]


@dataclass
class RedisPod:
    """The StatefulSet's start-up script run as the pod would run it: /data a temp dir, the
    port a free one, the server the test session's binary."""

    data: Path
    port: int = field(default_factory=free_port)
    started: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self) -> subprocess.Popen[bytes]:
        script = (_redis_script().replace("/data", str(self.data))
                  .replace("--port 6379", f"--port {self.port} --bind 127.0.0.1")
                  .replace("exec redis-server", f"exec {redis_server_for_tests()}"))
        proc = subprocess.Popen(["/bin/sh", "-c", script],
                                env={**os.environ, "REDIS_PASSWORD": "s3cret-admin"})
        self.started.append(proc)
        wait_until_sync(lambda: _pings(self.client("default", "s3cret-admin")), timeout=20)
        return proc

    def client(self, user: str, password: str) -> redis.Redis:
        return redis.Redis(port=self.port, username=user, password=password, socket_timeout=5)


@pytest.fixture
def redis_pod(tmp_path: Path) -> Iterator[RedisPod]:
    pod = RedisPod(tmp_path)
    yield pod
    for proc in pod.started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def test_redis_keeps_the_role_users_across_a_restart(redis_pod: RedisPod,
                                                      tmp_path: Path) -> None:
    # Given the pod's Redis, and a role user created and saved as `streamrl acl apply` does
    proc = redis_pod.start()
    admin = redis_pod.client("default", "s3cret-admin")
    admin.acl_setuser("streamrl-k8s-generator", enabled=True, passwords=["+role-pw"],
                      commands=["+ping"])
    admin.execute_command("ACL", "SAVE")
    admin.close()
    # When the server gets SIGTERM (pid 1 of its container: the script exec'd it)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0
    # and starts again
    redis_pod.start()
    # Then the role user still logs in, the admin too (start() waited for its PING), a wrong
    # password does not, and no password is in the ACL file
    assert _pings(redis_pod.client("streamrl-k8s-generator", "role-pw"))
    with pytest.raises(redis.AuthenticationError):
        redis_pod.client("default", "wrong").ping()
    acl = (tmp_path / "users.acl").read_text()
    assert acl.count("user default ") == 1 and "s3cret-admin" not in acl and "role-pw" not in acl
