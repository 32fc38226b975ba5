"""``make k8s-check``: render the kustomize base in deploy/kubernetes (or an overlay of it, such
as overlays/vllm) offline and validate it.

    python deploy/kubernetes/check.py [DIR] [--component DIR ...] [--print]

Rendering needs no kustomize, kubectl or cluster: :func:`render` reads ``kustomization.yaml``
and implements the fields this deployment uses, the way kustomize applies them (``resources``:
files and bases; ``components``; ``namespace``; ``labels`` with ``includeTemplates`` and no
selectors; ``configMapGenerator`` with ``files``, ``literals`` and ``behavior`` (create,
replace, merge) and no name hash; ``patches`` that delete a resource (``$patch: delete``);
``images``). Any other field, or any other patch, is an error: what kustomize would apply is
never silently skipped.

The render then passes, or the problems are printed and the exit status is 1:
1. every standard resource against Kubernetes 1.30's JSON schemas in strict mode (an unknown
   field is an error), from the PyPI package kubernetes-validate (bundled, offline);
2. the KEDA resources against keda-schema.json, a vendored subset of KEDA 2.x's CRD schema;
3. streamrl's own names and rules: the config TOML of the mounted ConfigMap loads with
   streamrl's schema; every streamrl container runs a real command (``streamrl run <actor>``,
   ``streamrl acl apply`` or the torchrun learner) with that config, as non-root with a
   read-only root, holds its own role's password only, and drains before it is killed; every
   ConfigMap, Secret (secrets.example.yaml, of the directory or its base: the template of the
   real ones), claim and service account it names exists, with the key named; every
   ScaledObject scales an actor Deployment on exactly the streams and consumer group streamrl
   uses for that stage (protocol/names.py for run.name and queues.shards), as an ACL user
   allowed the commands KEDA sends (protocol/roles.py), at the Redis the actors use, below the
   stage's concurrency; the inference servers and the learner request GPUs (one torchrun rank
   per GPU); the inference servers are generator.engine's; for SGLang,
   generator.server_urls, the router's --worker-urls and the SGLang pods name the same
   servers; for vLLM, server_urls name every vLLM pod and reach it on the port it listens
   on, and each server runs with the flags and environment streamrl's client needs
   (inference/vllm_server.py), with this checkout's worker extension on its PYTHONPATH; the
   learner and the servers share the volume the weights are written to; the executor pod
   allows the sandbox streamrl.toml asks for.

Not checked: what only a live cluster decides (admission, scheduling, storage classes, whether
KEDA, the GPU device plugin or user namespaces are there), SGLang's, vLLM's and torchrun's
flags beyond those named above, and the real Secrets' values. Nothing here has been applied to
a cluster.
"""

from __future__ import annotations

import argparse
import base64
import inspect
import json
import re
import sys
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import msgspec
import yaml

from streamrl.config.schema import Config, GeneratorConfig
from streamrl.inference.vllm_server import SERVER_ENVIRONMENT, serve_flags
from streamrl.protocol.names import GROUP_OF_STREAM, Names
from streamrl.protocol.roles import OPERATOR_ROLES, ROLES, run_grants
from streamrl.queues.acl import CONNECTION
from streamrl.queues.client import RedisURL
from streamrl.runtime.process import ACTORS, run_actor
from streamrl.sandbox.base import ISOLATION_LEVELS

HERE = Path(__file__).resolve().parent
KEDA_SCHEMA = HERE / "keda-schema.json"
VLLM_EXTENSION = HERE.parents[1] / "inference" / "vllm_ext"
"""The worker extension every vLLM server imports (``--worker-extension-cls``)."""
VLLM_PORT = 8000
"""``vllm serve``'s port without ``--port``."""
SECRETS_TEMPLATE = "secrets.example.yaml"
KUBERNETES_VERSION = "1.30"
GPU = "nvidia.com/gpu"
DRAIN_S: float = inspect.signature(run_actor).parameters["drain_timeout_s"].default
"""How long an actor drains its work in hand on SIGTERM (runtime/process.py)."""

Resource = dict[str, Any]


# -- rendering: the subset of kustomize this deployment uses ----------------------------------

class RenderError(Exception):
    """A kustomization this renderer cannot render as kustomize would."""


FIELDS = {"apiVersion", "kind", "namespace", "labels", "resources", "components",
          "configMapGenerator", "generatorOptions", "patches", "images"}
CLUSTER_SCOPED = {"Namespace", "PersistentVolume", "StorageClass", "ClusterRole",
                  "CustomResourceDefinition", "PriorityClass", "ClusterTriggerAuthentication"}
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}


def render(directory: Path, components: Sequence[Path] = ()) -> list[Resource]:
    """What ``kustomize build directory`` prints (in file order), with ``components`` added as
    if its kustomization listed them."""
    return _build(Path(directory), "Kustomization", [], components)


def _build(directory: Path, kind: str, resources: list[Resource],
           components: Sequence[Path] = ()) -> list[Resource]:
    """A Kustomization renders into a list of its own; a Component adds to, and transforms,
    the list of the kustomization that uses it (kustomize's order before 5.1: resources,
    components, generators, then the transformers, patches first; 5.1 runs the generators
    before the components, so what renders here renders with both)."""
    k = _kustomization(directory, kind)
    for entry in k.get("resources", []):
        path = directory / entry
        resources += _build(path, "Kustomization", []) if path.is_dir() else _documents(path)
    for path in [*(directory / c for c in k.get("components", [])), *components]:
        _build(path, "Component", resources)
    _generate(directory, k, resources)
    for entry in k.get("patches", []):
        _patch(directory, resources, entry)
    if k.get("namespace"):
        _set_namespace(resources, k["namespace"])
    for spec in k.get("labels", []):
        _add_labels(resources, spec)
    for entry in k.get("images", []):
        _set_image(resources, entry)
    return resources


def _kustomization(directory: Path, kind: str) -> dict[str, Any]:
    path = directory / "kustomization.yaml"
    if not path.is_file():
        raise RenderError(f"{directory}: no kustomization.yaml")
    k = yaml.safe_load(path.read_text()) or {}
    if k.get("kind", "Kustomization") != kind:
        raise RenderError(f"{path}: kind {k.get('kind')!r} where a {kind} is expected")
    if unknown := sorted(set(k) - FIELDS):
        raise RenderError(f"{path}: {unknown}: not implemented by check.py's renderer")
    return k


def _documents(path: Path) -> list[Resource]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    for d in docs:
        if not (isinstance(d, dict) and d.get("kind") and _get(d, "metadata", "name")):
            raise RenderError(f"{path}: a document without kind or metadata.name")
    return docs


def _generate(directory: Path, k: dict[str, Any], resources: list[Resource]) -> None:
    """``configMapGenerator``: each ConfigMap added (``behavior: create``, the default), or in
    place of the one of that name already rendered (``replace``: its data; ``merge``: its data
    updated), keeping that one's name, namespace and labels, as kustomize does."""
    generators = k.get("configMapGenerator", [])
    if generators and k.get("generatorOptions") != {"disableNameSuffixHash": True}:
        raise RenderError(f"{directory}: generatorOptions must be {{disableNameSuffixHash: true}}"
                          " (check.py does not implement kustomize's name hash)")
    for g in generators:
        if unknown := sorted(set(g) - {"name", "behavior", "files", "literals"}):
            raise RenderError(f"{directory}: configMapGenerator {g.get('name')}: {unknown}")
        data: dict[str, str] = {}
        for item in g.get("files", []):
            key, sep, rel = item.partition("=")
            key, rel = (key, rel) if sep else (PurePosixPath(item).name, item)
            data[key] = (directory / rel).read_text()
        for item in g.get("literals", []):
            key, sep, value = item.partition("=")
            if not sep or key in data:
                raise RenderError(f"{directory}: configMapGenerator {g['name']}: literal {key!r}")
            data[key] = value
        made = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": g["name"]},
                "data": data}
        behavior = g.get("behavior", "create")
        old = [i for i, r in enumerate(resources)
               if r["kind"] == "ConfigMap" and r["metadata"]["name"] == g["name"]]
        if behavior not in ("create", "replace", "merge"):
            raise RenderError(f"{directory}: configMapGenerator {g['name']}: behavior {behavior!r}")
        if behavior == "create":
            if old:
                raise RenderError(f"{directory}: ConfigMap {g['name']} exists: behavior must be "
                                  f"merge or replace")
            resources.append(made)
            continue
        if len(old) != 1:
            raise RenderError(f"{directory}: configMapGenerator {g['name']}: {len(old)} ConfigMaps "
                              f"of that name to {behavior} (a component's generators run before "
                              f"its parent's in kustomize < 5.1: replace them from an overlay)")
        was = resources[old[0]]
        made["metadata"] = {**was["metadata"], "labels": {
            **_get(was, "metadata", "labels", default={})}}
        made["data"] = {**(was.get("data") or {}), **data} if behavior == "merge" else data
        resources[old[0]] = made


def _patch(directory: Path, resources: list[Resource], entry: dict[str, Any]) -> None:
    """``patches``: strategic-merge patches that delete a resource (``$patch: delete``; kustomize
    finds it by apiVersion, kind and name). Any other patch is refused, not skipped."""
    if set(entry) - {"path", "patch"} or len(entry) != 1:
        raise RenderError(f"{directory}: patches: {entry}: only one of path or patch (no target, "
                          f"no options)")
    text = (directory / entry["path"]).read_text() if "path" in entry else entry["patch"]
    for doc in (d for d in yaml.safe_load_all(text) if d is not None):
        ident = {"apiVersion", "kind", "metadata", "$patch"}
        if not isinstance(doc, dict) or doc.get("$patch") != "delete" or set(doc) - ident or \
                set(doc["metadata"]) - {"name", "namespace"}:
            raise RenderError(f"{directory}: patches: only strategic-merge patches that delete a "
                              f"resource ($patch: delete) are implemented by check.py's renderer")
        meta = doc["metadata"]
        found = [r for r in resources if (r.get("apiVersion"), r["kind"], r["metadata"]["name"])
                 == (doc.get("apiVersion"), doc.get("kind"), meta.get("name"))
                 and meta.get("namespace") in (None, r["metadata"].get("namespace"))]
        if len(found) != 1:
            raise RenderError(f"{directory}: patches: {len(found)} resources match the deletion "
                              f"of {doc.get('kind')}/{meta.get('name')}")
        resources.remove(found[0])


def _set_namespace(resources: list[Resource], namespace: str) -> None:
    for r in resources:
        if r["kind"] in ("RoleBinding", "ClusterRoleBinding"):
            raise RenderError("namespace: the subjects of role bindings are not implemented")
        if r["kind"] == "Namespace":
            r["metadata"]["name"] = namespace
        elif r["kind"] not in CLUSTER_SCOPED:
            r["metadata"]["namespace"] = namespace


def _add_labels(resources: list[Resource], spec: dict[str, Any]) -> None:
    known = {"pairs", "includeSelectors", "includeTemplates"}
    if set(spec) - known or spec.get("includeSelectors"):
        raise RenderError("labels: only pairs, includeTemplates and includeSelectors: false")
    for r in resources:
        targets = [r]
        if spec.get("includeTemplates") and r["kind"] in WORKLOADS:
            targets.append(r.setdefault("spec", {}).setdefault("template", {}))
        elif spec.get("includeTemplates") and r["kind"] == "CronJob":
            job = r.setdefault("spec", {}).setdefault("jobTemplate", {})
            targets += [job, job.setdefault("spec", {}).setdefault("template", {})]
        for t in targets:
            t.setdefault("metadata", {}).setdefault("labels", {}).update(spec["pairs"])


def split_image(image: str) -> tuple[str, str, str]:
    """(name, tag, digest) of an image reference; a registry's port is part of the name."""
    rest, _, digest = image.partition("@")
    name, colon, tag = rest.rpartition(":")
    return (name, tag, digest) if colon and "/" not in tag else (rest, "", digest)


def _set_image(resources: list[Resource], entry: dict[str, Any]) -> None:
    if set(entry) - {"name", "newName", "newTag", "digest"}:
        raise RenderError(f"images: {entry}: only name, newName, newTag, digest")
    for r in resources:
        for c in containers(r):
            name, tag, digest = split_image(c.get("image", ""))
            if name != entry["name"]:
                continue
            name = entry.get("newName", name)
            tag, digest = (("", entry["digest"]) if "digest" in entry else
                           (entry["newTag"], "") if "newTag" in entry else (tag, digest))
            c["image"] = name + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")


# -- the render, indexed ------------------------------------------------------------------------

def _get(obj: Any, *path: str | int, default: Any = None) -> Any:
    for key in path:
        try:
            obj = obj[key]
        except (KeyError, IndexError, TypeError):
            return default
    return default if obj is None else obj


def pod_spec(r: Resource) -> dict[str, Any]:
    if r.get("kind") == "Pod":
        return _get(r, "spec", default={})
    if r.get("kind") == "CronJob":
        return _get(r, "spec", "jobTemplate", "spec", "template", "spec", default={})
    return _get(r, "spec", "template", "spec", default={}) if r.get("kind") in WORKLOADS else {}


def containers(r: Resource) -> list[dict[str, Any]]:
    spec = pod_spec(r)
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


@dataclass(frozen=True)
class Process:
    """A container of a streamrl image: its workload, its command line and its role (an actor
    of ``streamrl run``, ``acl`` for ``streamrl acl apply``, "" for anything else)."""

    owner: Resource
    container: dict[str, Any]

    @property
    def argv(self) -> list[str]:
        return [*self.container.get("command", []), *self.container.get("args", [])]

    @property
    def role(self) -> str:
        argv = self.argv
        if argv[:2] == ["streamrl", "run"] and len(argv) > 2:
            return argv[2]
        if argv[:3] == ["streamrl", "acl", "apply"]:
            return "acl"
        if argv[:1] == ["torchrun"] and flag(argv, "-m") == "streamrl.actors.learner":
            return "learner"
        return ""

    @property
    def where(self) -> str:
        return f"{self.owner['kind']}/{self.owner['metadata']['name']} ({self.container['name']})"


def flag(argv: Sequence[str], name: str) -> str | None:
    """The value of ``name`` in ``argv`` (``--x v`` or ``--x=v``; ``-`` and ``_`` alike)."""
    norm = name.replace("_", "-")
    for i, arg in enumerate(argv):
        key, eq, value = arg.partition("=")
        if key.replace("_", "-") == norm:
            return value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return None


@dataclass
class Cluster:
    """The rendered resources by kind and name, and the keys and values of the Secrets (the
    template's: the real ones are never in the repository)."""

    resources: list[Resource]
    secrets: dict[str, dict[str, str]]
    namespace: str = field(init=False)

    def __post_init__(self) -> None:
        spaces = {_get(r, "metadata", "namespace") for r in self.resources} - {None}
        self.namespace = spaces.pop() if len(spaces) == 1 else "default"

    def named(self, kind: str) -> dict[str, Resource]:
        return {r["metadata"]["name"]: r for r in self.resources if r["kind"] == kind}

    def processes(self) -> list[Process]:
        return [Process(r, c) for r in self.resources for c in containers(r)
                if split_image(c.get("image", ""))[0].rpartition("/")[2].startswith("streamrl")]

    def keys(self, kind: str, name: str) -> dict[str, str] | None:
        """The data of ConfigMap or Secret ``name`` (None: there is none)."""
        if kind == "Secret" and name in self.secrets:
            return self.secrets[name]
        found = self.named(kind).get(name)
        return None if found is None else _secret_data(found)

    def env(self, p: Process) -> dict[str, str | None]:
        """Every variable of the container, with its value where the render knows it."""
        out: dict[str, str | None] = {}
        for source in p.container.get("envFrom", []):
            for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
                if key in source:
                    data = self.keys(kind, _get(source, key, "name")) or {}
                    out.update({source.get("prefix", "") + k: v for k, v in data.items()})
        for var in p.container.get("env", []):
            ref = _get(var, "valueFrom", default={})
            kind, src = (("ConfigMap", ref["configMapKeyRef"]) if "configMapKeyRef" in ref else
                         ("Secret", ref.get("secretKeyRef", {})))
            out[var["name"]] = (var["value"] if "value" in var else
                                (self.keys(kind, src.get("name", "")) or {}).get(src.get("key")))
        return out


def _secret_data(r: Resource) -> dict[str, str]:
    """The data of a ConfigMap, or of a Secret (``data`` base64-decoded, and ``stringData``)."""
    data = dict(r.get("data") or {})
    if r["kind"] != "Secret":
        return data
    return {k: base64.b64decode(v).decode() for k, v in data.items()} | (r.get("stringData") or {})


# -- validation ----------------------------------------------------------------------------------

@dataclass
class Report:
    resources: list[Resource]
    problems: list[str]


def secrets_template(directory: Path) -> Path:
    """secrets.example.yaml of ``directory``, else of the first base it renders that has one
    (an overlay checks against its base's)."""
    if (directory / SECRETS_TEMPLATE).is_file():
        return directory / SECRETS_TEMPLATE
    for entry in _kustomization(directory, "Kustomization").get("resources", []):
        if (directory / entry).is_dir():
            try:
                return secrets_template(directory / entry)
            except RenderError:
                continue
    raise RenderError(f"{directory}: no {SECRETS_TEMPLATE} here or in a base")


def check(directory: Path = HERE, components: Sequence[Path] = ()) -> Report:
    """Render ``directory`` (with ``components``) and every problem found in it."""
    try:
        resources = render(directory, components)
        template = secrets_template(Path(directory))
        secrets = {r["metadata"]["name"]: _secret_data(r) for r in _documents(template)}
    except (RenderError, OSError, yaml.YAMLError) as exc:
        return Report([], [f"render: {exc}"])
    cluster = Cluster(resources, secrets)
    problems = validate_schemas(resources) + check_references(cluster)
    config, found = load_config(cluster)
    problems += found
    if config is not None:
        for step in CHECKS:
            problems += step(cluster, config)
    return Report(resources, problems)


def validate_schemas(resources: list[Resource]) -> list[str]:
    keda = json.loads(KEDA_SCHEMA.read_text())
    problems = []
    for r in resources:
        where = f"{r['kind']}/{r['metadata']['name']}"
        if str(r.get("apiVersion", "")).startswith("keda.sh/"):
            if r["kind"] not in ("ScaledObject", "TriggerAuthentication"):
                problems.append(f"{where}: not in the vendored KEDA schema (keda-schema.json)")
                continue
            validator = jsonschema.Draft202012Validator({**keda, "$ref": f"#/$defs/{r['kind']}"})
            for error in validator.iter_errors(r):
                best = jsonschema.exceptions.best_match([error])
                path = ".".join(str(p) for p in best.absolute_path)
                problems.append(f"{where}: {path}: {best.message} (KEDA schema)")
            continue
        try:
            kubernetes_validate.validate(r, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            problems.append(f"{where}: {path}: {exc.message} (Kubernetes {KUBERNETES_VERSION})")
        except kubernetes_validate.SchemaNotFoundError:
            problems.append(f"{where}: no Kubernetes {KUBERNETES_VERSION} schema for "
                            f"{r.get('apiVersion')} {r['kind']}")
    return problems


def check_references(cluster: Cluster) -> list[str]:
    """Every ConfigMap, Secret, claim, service account and key a pod or trigger names exists."""
    problems = []

    def need(where: str, kind: str, name: str, key: str | None = None) -> None:
        data = cluster.keys(kind, name) if kind in ("ConfigMap", "Secret") else (
            {} if name in cluster.named(kind) else None)
        if data is None:
            problems.append(f"{where}: {kind} {name!r} is not in the render"
                            + (f" nor in {SECRETS_TEMPLATE}" if kind == "Secret" else ""))
        elif key is not None and key not in data:
            problems.append(f"{where}: {kind} {name!r} has no key {key!r}")

    for r in cluster.resources:
        spec, where = pod_spec(r), f"{r['kind']}/{r['metadata']['name']}"
        if spec.get("serviceAccountName"):
            need(where, "ServiceAccount", spec["serviceAccountName"])
        claims = {_get(t, "metadata", "name") for t in _get(r, "spec", "volumeClaimTemplates",
                                                               default=[])}
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for v in volumes.values():
            if "configMap" in v:
                for item in [*_get(v, "configMap", "items", default=[])] or [{"key": None}]:
                    need(where, "ConfigMap", v["configMap"]["name"], item["key"])
            if "secret" in v:
                need(where, "Secret", v["secret"]["secretName"])
            if "persistentVolumeClaim" in v:
                need(where, "PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"])
        for c in containers(r):
            for m in c.get("volumeMounts", []):
                if m["name"] not in volumes and m["name"] not in claims:
                    problems.append(f"{where}: volumeMount {m['name']!r} names no volume")
            for var in c.get("env", []):
                for kind, ref in (("ConfigMap", "configMapKeyRef"), ("Secret", "secretKeyRef")):
                    src = _get(var, "valueFrom", ref)
                    if src and not src.get("optional"):
                        need(where, kind, src["name"], src["key"])
            for source in c.get("envFrom", []):
                for kind, ref in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
                    if ref in source:
                        need(where, kind, source[ref]["name"])
    for auth in cluster.named("TriggerAuthentication").values():
        for ref in _get(auth, "spec", "secretTargetRef", default=[]):
            need(f"TriggerAuthentication/{auth['metadata']['name']}", "Secret", ref["name"],
                 ref["key"])
    for so in cluster.named("ScaledObject").values():
        for t in _get(so, "spec", "triggers", default=[]):
            if _get(t, "authenticationRef", "kind", default="TriggerAuthentication") == \
                    "TriggerAuthentication" and "authenticationRef" in t:
                need(f"ScaledObject/{so['metadata']['name']}", "TriggerAuthentication",
                     t["authenticationRef"]["name"])
    return problems


def mounted_file(cluster: Cluster, p: Process, path: str) -> tuple[str, str] | None:
    """(ConfigMap, key) of the file ``path`` in the container, if a ConfigMap provides it."""
    volumes = {v["name"]: v for v in pod_spec(p.owner).get("volumes", [])}
    for m in p.container.get("volumeMounts", []):
        cm = _get(volumes, m["name"], "configMap")
        if cm is None:
            continue
        if path == m["mountPath"] and m.get("subPath"):
            rel = m["subPath"]
        elif path.startswith(m["mountPath"].rstrip("/") + "/") and not m.get("subPath"):
            rel = path[len(m["mountPath"].rstrip("/")) + 1:]
        else:
            continue
        items = {i["path"]: i["key"] for i in cm.get("items", [])}
        return cm["name"], items.get(rel, rel) if items else rel
    return None


def load_config(cluster: Cluster) -> tuple[Config | None, list[str]]:
    """The one streamrl config every streamrl container reads (``--config``), loaded."""
    problems, sources = [], set()
    for p in cluster.processes():
        path = flag(p.argv, "--config")
        source = mounted_file(cluster, p, path) if path else None
        if source is None:
            problems.append(f"{p.where}: --config {path} is not a file of a mounted ConfigMap")
        else:
            sources.add(source)
    if len(sources) != 1:
        return None, [*problems, f"streamrl containers read {len(sources)} configs "
                                 f"{sorted(sources)}, expected one"]
    name, key = sources.pop()
    text = (cluster.keys("ConfigMap", name) or {}).get(key)
    if text is None:
        return None, problems  # check_references names it
    try:
        return msgspec.convert(tomllib.loads(text), Config), problems
    except (tomllib.TOMLDecodeError, msgspec.ValidationError) as exc:
        return None, [*problems, f"ConfigMap/{name} {key}: {exc}"]


def _actors(cluster: Cluster) -> list[Process]:
    return [p for p in cluster.processes() if p.role in ACTORS]


def check_processes(cluster: Cluster, config: Config) -> list[str]:
    """Real commands, hardened containers, time to drain, the metrics port."""
    problems = []
    for p in cluster.processes():
        if p.role not in (*ACTORS, "acl"):
            problems.append(f"{p.where}: runs {' '.join(p.argv) or 'the image entrypoint'}: "
                            f"neither `streamrl run <{'|'.join(ACTORS)}>`, `streamrl acl "
                            f"apply` nor `torchrun ... -m streamrl.actors.learner`")
            continue
        pod, sc = pod_spec(p.owner), p.container.get("securityContext", {})
        non_root = sc.get("runAsNonRoot", _get(pod, "securityContext", "runAsNonRoot"))
        if not (non_root and sc.get("readOnlyRootFilesystem")
                and sc.get("allowPrivilegeEscalation") is False):
            problems.append(f"{p.where}: needs runAsNonRoot, readOnlyRootFilesystem and "
                            f"allowPrivilegeEscalation: false")
        if p.role == "acl":
            continue
        grace = pod.get("terminationGracePeriodSeconds", 30)
        if grace <= DRAIN_S:
            problems.append(f"{p.where}: terminationGracePeriodSeconds {grace}: an actor drains "
                            f"for up to {DRAIN_S:g} s on SIGTERM before it stops")
        ports = {port.get("containerPort") for port in p.container.get("ports", [])}
        if config.ops.metrics_port > 0 and config.ops.metrics_port not in ports:
            problems.append(f"{p.where}: no containerPort {config.ops.metrics_port} "
                            f"(ops.metrics_port)")
    return problems


def check_credentials(cluster: Cluster, config: Config) -> list[str]:
    """Each actor holds its own role's password only and a Redis URL without one; the ACL
    Job holds every role's password and the admin URL."""
    if not config.auth.enabled:
        return ["streamrl.toml: auth.enabled = false: every pod would log in with the URL's own "
                "credentials instead of its role's (docs/security.md)"]
    passwords = {config.auth.password_env_of(r) for r in ROLES}
    problems = []
    for p in cluster.processes():
        env = cluster.env(p)
        url = env.get("STREAMRL_REDIS_URL")
        held = passwords & set(env)
        if p.role == "acl":
            needed = {config.auth.password_env_of(r) for r in ROLES if r not in OPERATOR_ROLES}
            if missing := sorted(needed - held):
                problems.append(f"{p.where}: `acl apply` needs every role's password: {missing}")
        elif p.role in ACTORS:
            own = config.auth.password_env_of(p.role)
            if held != {own}:
                problems.append(f"{p.where}: holds {sorted(held)}: an actor holds its own "
                                f"role's password ({own}) and no other")
            if url and urlsplit(url).password:
                problems.append(f"{p.where}: STREAMRL_REDIS_URL holds a password: an actor "
                                f"logs in as its role's user")
        if "STREAMRL_REDIS_URL" not in env:
            problems.append(f"{p.where}: no STREAMRL_REDIS_URL")
    return problems + _redis_problems(cluster)


def _redis_problems(cluster: Cluster) -> list[str]:
    """The actors share one Redis URL; the ACL Job's admin URL names the same Redis; an
    in-cluster Redis is a Service of the render with that port."""
    url, ns = _redis_url(cluster), cluster.namespace
    if url is None:
        return ["the actors' STREAMRL_REDIS_URL is unknown or not the same in every actor"]
    problems = []
    for p in (p for p in cluster.processes() if p.role == "acl"):
        admin = cluster.env(p).get("STREAMRL_REDIS_URL")
        if admin and _nodes(admin, ns) != _nodes(url, ns):
            problems.append(f"{p.where}: its admin URL names another Redis than the actors' "
                            f"{url}")
    services = cluster.named("Service")
    for host, port in _nodes(url, ns):
        svc, _, rest = host.partition(".")
        ports = {str(x.get("port")) for x in _get(services, svc, "spec", "ports", default=[])}
        if rest == f"{ns}.svc.cluster.local" and port not in ports:
            problems.append(f"the actors' Redis {host}:{port}: no Service {svc!r} with that "
                            f"port in the render")
    return problems


def _redis_url(cluster: Cluster) -> str | None:
    urls = {cluster.env(p).get("STREAMRL_REDIS_URL") for p in _actors(cluster)} - {None}
    return urls.pop() if len(urls) == 1 else None


def _canonical(host: str, namespace: str) -> str:
    """A Service's host name in full (``svc`` and ``svc.ns[.svc]`` alike); others as given."""
    parts = host.split(".")
    if len(parts) == 1:
        parts.append(namespace)
    if len(parts) >= 2 and parts[2:] in ([], ["svc"], ["svc", "cluster", "local"]):
        return f"{parts[0]}.{parts[1]}.svc.cluster.local"
    return host


def _glob_matches(key: str, pattern: str) -> bool:
    """Redis's glob as streamrl's ACL patterns use it (``*``, ``?``, backslash escapes)."""
    regex = re.sub(r"\\(.)|(\*)|(\?)|(.)", lambda m: re.escape(m[1]) if m[1] else
                   ".*" if m[2] else "." if m[3] else re.escape(m[4]), pattern, flags=re.S)
    return re.fullmatch(regex, key, flags=re.S) is not None


def may(config: Config, role: str, command: str, key: str) -> bool:
    """Whether ``role``'s ACL user may send ``command`` on ``key`` (the grants `streamrl acl
    apply` gives it, runtime/auth.py; keyless commands: the connection's)."""
    if command in CONNECTION:
        return True
    shards = config.queues.shards
    grants = run_grants(Names(config.run.name), role, shards if shards > 1 else 0)
    return any(command in g.commands and any(_glob_matches(key, p) for p in (*g.rw, *g.read))
               for g in grants)


def check_keda(cluster: Cluster, config: Config) -> list[str]:
    """Every ScaledObject scales an actor stage on exactly its streams and consumer group."""
    problems = []
    stage_stream = {group: stream for stream, group in GROUP_OF_STREAM.items()}
    names = Names(config.run.name, shards=config.queues.shards)
    roles = {(p.owner["kind"], p.owner["metadata"]["name"]): p.role for p in _actors(cluster)}
    for so in cluster.named("ScaledObject").values():
        where, spec = f"ScaledObject/{so['metadata']['name']}", so.get("spec", {})
        if spec.get("minReplicaCount", 0) > spec.get("maxReplicaCount", 100):
            problems.append(f"{where}: minReplicaCount above maxReplicaCount")
        kind, name = _get(spec, "scaleTargetRef", "kind", default="Deployment"), \
            _get(spec, "scaleTargetRef", "name")
        target = cluster.named(kind).get(name)
        if target is None:
            problems.append(f"{where}: scaleTargetRef names {kind} {name!r}, not in the render")
            continue
        if "replicas" in target.get("spec", {}):
            problems.append(f"{where}: {kind}/{name} sets spec.replicas: each `kubectl apply` "
                            f"would reset the count KEDA set; leave it out")
        role = roles.get((kind, name), "")
        if role not in stage_stream:
            problems.append(f"{where}: {kind}/{name} runs {role or 'no streamrl actor'}, not a "
                            f"stage that reads a stream in a consumer group "
                            f"({', '.join(stage_stream)})")
            continue
        stream = stage_stream[role]
        expected = {layout.stream(stream) for layout in names.layouts()}
        seen: set[str] = set()
        for i, trigger in enumerate(spec.get("triggers", [])):
            seen.add(_get(trigger, "metadata", "stream", default=""))
            problems += [f"{where}: triggers.{i}: {m}" for m in
                         _trigger_problems(cluster, config, (role, stream), expected, trigger)]
        if missing := sorted(expected - seen):
            problems.append(f"{where}: no trigger on {missing}")
    return problems


def _trigger_problems(cluster: Cluster, config: Config, stage: tuple[str, str],
                      expected: set[str], trigger: dict[str, Any]) -> list[str]:
    """One trigger of the ScaledObject of ``stage`` (its role, and the stream it reads)."""
    (role, input_stream), meta, problems = stage, trigger.get("metadata", {}), []
    stream, group = meta.get("stream"), Names(config.run.name).group(input_stream)
    if stream not in expected:
        problems.append(f"stream {stream!r}: the {role}s of run {config.run.name!r} read "
                        f"{sorted(expected)} (protocol/names.py)")
    if meta.get("consumerGroup") != group:
        problems.append(f"consumerGroup {meta.get('consumerGroup')!r}: the {role}s read "
                        f"{stream} in group {group!r}")
    target, limit = str(meta.get("pendingEntriesCount", "5")), getattr(config, role).concurrency
    if "consumerGroup" in meta and "lagCount" not in meta and target.isdigit() and \
            int(target) >= limit:
        problems.append(f"pendingEntriesCount {target} >= {role}.concurrency {limit}: a "
                        f"replica never holds more than {limit} pending entries, so the stage "
                        f"would never scale up")
    users = {config.auth.user_of(config.run.name, r): r for r in ROLES}
    user_role = users.get(meta.get("username", ""))
    if user_role is None:
        problems.append(f"username {meta.get('username')!r} is none of the run's ACL users "
                        f"{sorted(users)}")
    else:
        commands = (("info", "xinfo|groups", "xlen") if "lagCount" in meta else
                    ("xpending",) if "consumerGroup" in meta else ("xlen",))
        for command in commands:
            if not may(config, user_role, command, str(stream)):
                problems.append(f"user {meta['username']} ({user_role}) may not send "
                                f"{command.upper()} on {stream} (protocol/roles.py)")
        if user_role != "autoscaler":
            own = config.auth.user_of(config.run.name, "autoscaler")
            problems.append(f"user {meta['username']} ({user_role}) may do more than KEDA "
                            f"needs: connect as {own} (autoscaler: XPENDING of the scaled "
                            f"groups only)")
        problems += _auth_problems(cluster, config, user_role, trigger)
    return problems + _address_problems(cluster, trigger)


def _auth_problems(cluster: Cluster, config: Config, user_role: str,
                   trigger: dict[str, Any]) -> list[str]:
    """The trigger's password is its user's, and the ACL Job creates that user."""
    auth = cluster.named("TriggerAuthentication").get(_get(trigger, "authenticationRef", "name"))
    refs = {r["parameter"]: r for r in _get(auth, "spec", "secretTargetRef", default=[])}
    own = config.auth.password_env_of(user_role)
    problems = []
    if _get(refs, "password", "key") != own:
        problems.append(f"the password of {config.auth.user_of(config.run.name, user_role)} "
                        f"is {own} (a TriggerAuthentication's secretTargetRef `password`)")
    acl = [p for p in cluster.processes() if p.role == "acl"]
    if not any(own in cluster.env(p) for p in acl):
        problems.append(f"no `streamrl acl apply` gets {own}: user {user_role!r} would not "
                        f"exist")
    return problems


def _nodes(url: str, namespace: str) -> set[tuple[str, str]]:
    """The (host, port) of every node a Redis URL names, Service names in full."""
    redis_url, parts = RedisURL(url), urlsplit(url)
    nodes = redis_url.seeds if redis_url.cluster else [(parts.hostname or "", parts.port or 6379)]
    return {(_canonical(host, namespace), str(port)) for host, port in nodes}


def _address_problems(cluster: Cluster, trigger: dict[str, Any]) -> list[str]:
    """The trigger reaches the Redis the actors use, by a name KEDA's namespace resolves."""
    meta, url, ns = trigger.get("metadata", {}), _redis_url(cluster), cluster.namespace
    if url is None:
        return []  # _redis_problems says so
    cluster_url = RedisURL(url).cluster
    wanted = "redis-cluster-streams" if cluster_url else "redis-streams"
    if trigger.get("type") != wanted:
        return [f"type {trigger.get('type')!r}: {url} needs {wanted!r}"]
    listed = meta.get("addresses" if cluster_url else "address", "")
    given = [a.strip().rpartition(":") for a in listed.split(",") if a.strip()]
    problems = [f"address {h}: a short name resolves in KEDA's own namespace; use "
                f"{_canonical(h, ns)}" for h, _, _ in given if "." not in h]
    if {(_canonical(h, ns), p) for h, _, p in given} != _nodes(url, ns):
        problems.append(f"address {listed!r} is not the actors' Redis ({url})")
    if (meta.get("enableTLS") == "true") != urlsplit(url).scheme.startswith("rediss"):
        problems.append(f"enableTLS {meta.get('enableTLS')!r} for {urlsplit(url).scheme}://")
    return problems


def _gpus(container: dict[str, Any]) -> tuple[int, int]:
    res = container.get("resources", {})
    return int(_get(res, "requests", GPU, default=0)), int(_get(res, "limits", GPU, default=0))


def _runs(p: Process | dict[str, Any], module: str) -> bool:
    c = p.container if isinstance(p, Process) else p
    argv = [*c.get("command", []), *c.get("args", [])]
    return any(argv[i:i + 2] == ["-m", module] for i in range(len(argv)))


def _is_vllm(container: dict[str, Any]) -> bool:
    """A vLLM server: ``vllm serve``, its module, or vLLM's image with its entrypoint."""
    argv = [*container.get("command", []), *container.get("args", [])]
    image = split_image(container.get("image", ""))[0].rpartition("/")[2]
    return (len(argv) > 1 and PurePosixPath(argv[0]).name == "vllm" and argv[1] == "serve") or \
        _runs(container, "vllm.entrypoints.openai.api_server") or \
        (image == "vllm-openai" and not container.get("command"))


def servers(cluster: Cluster, engine: str) -> list[tuple[Resource, dict[str, Any]]]:
    """(workload, container) of every inference server of ``engine`` ('sglang', 'vllm')."""
    runs: Callable[[dict[str, Any]], bool] = (
        _is_vllm if engine == "vllm" else lambda c: _runs(c, "sglang.launch_server"))
    return [(r, c) for r in cluster.resources for c in containers(r) if runs(c)]


ENGINES = {"sglang": "an SGLang", "vllm": "a vLLM"}


def check_learner_and_gpus(cluster: Cluster, config: Config) -> list[str]:
    """One learner, one torchrun rank per GPU it requests; a GPU for every SGLang server, and
    for a vLLM server as many as its tensor-parallel size."""
    problems = []
    learners = [p for p in _actors(cluster) if p.role == "learner"]
    if len(learners) != 1 or _get(learners[0].owner, "spec", "replicas", default=1) != 1:
        problems.append(f"one learner per run: found {len(learners)} learner containers "
                        f"{[p.where for p in learners]} (with replicas: 1)")
    for p in learners:
        requests, limits = _gpus(p.container)
        nproc = (flag(p.argv, "--nproc-per-node") or "1") if p.argv[0] == "torchrun" else "1"
        if not nproc.isdigit():
            problems.append(f"{p.where}: --nproc-per-node {nproc}: give the GPU count")
            continue
        ranks = int(nproc)
        if requests not in (0, limits):
            problems.append(f"{p.where}: {GPU} requests {requests} != limits {limits}")
        if config.learner.device.startswith("cuda") and limits != ranks:
            problems.append(f"{p.where}: learner.device = {config.learner.device!r} with "
                            f"{ranks} rank(s) on {limits} GPU(s) ({GPU} limits): one rank per GPU")
    for engine, article in ENGINES.items():
        for r, c in servers(cluster, engine):
            requests, limits = _gpus(c)
            argv = [*c.get("command", []), *c.get("args", [])]
            size = flag(argv, "--tensor-parallel-size") or flag(argv, "-tp") or "1"
            wanted = f"{size} (its --tensor-parallel-size)" if engine == "vllm" else "at least 1"
            if limits < 1 or requests not in (0, limits) or (
                    engine == "vllm" and str(limits) != size):
                problems.append(f"{r['kind']}/{r['metadata']['name']} ({c['name']}): {article} "
                                f"server needs {GPU} limits {wanted} (and requests equal to "
                                f"them)")
    return problems


def _serving(cluster: Cluster, url: str) -> tuple[Resource, Resource] | str:
    """The workload and the Service behind an in-cluster ``http://`` URL (a Service, or a
    StatefulSet's pod behind its headless Service), or why there is none."""
    parts = urlsplit(url)
    first, _, rest = (parts.hostname or "").partition(".")
    services, sets = cluster.named("Service"), cluster.named("StatefulSet").values()
    svc = services.get(rest.split(".")[0]) if rest else None
    if svc is not None and _get(svc, "spec", "clusterIP") == "None":
        for sts in sets:
            ordinal = first.removeprefix(f"{sts['metadata']['name']}-")
            if _get(sts, "spec", "serviceName") == rest.split(".")[0] and ordinal.isdigit():
                if int(ordinal) >= _get(sts, "spec", "replicas", default=1):
                    return f"{url}: StatefulSet/{sts['metadata']['name']} has no pod {first}"
                workload = sts
                break
        else:
            return f"{url}: no StatefulSet pod {first!r} behind Service {rest.split('.')[0]!r}"
    elif (svc := services.get(first)) is not None:
        selector = _get(svc, "spec", "selector", default={})
        found = [r for r in cluster.resources if r["kind"] in WORKLOADS and selector and
                 selector.items() <= _get(r, "spec", "template", "metadata", "labels",
                                          default={}).items()]
        if len(found) != 1:
            return f"{url}: Service {first!r} selects {len(found)} workloads"
        workload = found[0]
    else:
        return f"{url}: no Service {first!r} in the render"
    if parts.port not in {p.get("port") for p in _get(svc, "spec", "ports", default=[])}:
        return f"{url}: Service {svc['metadata']['name']!r} has no port {parts.port}"
    return workload, svc


def check_inference(cluster: Cluster, config: Config) -> list[str]:
    """The inference servers in the render are generator.engine's, and the generators reach
    every one of them (by engine: :func:`_sglang_problems`, :func:`_vllm_problems`)."""
    gen = config.generator
    problems = [f"{r['kind']}/{r['metadata']['name']} ({c['name']}): {article} server, but "
                f"generator.engine is {gen.engine!r}: no generator sends it requests or weights"
                for engine, article in ENGINES.items() if engine != gen.engine
                for r, c in servers(cluster, engine)]
    if gen.engine == "sglang":
        problems += _sglang_problems(cluster, gen)
    elif gen.engine == "vllm":
        problems += _vllm_problems(cluster, gen)
    return problems


def _sglang_problems(cluster: Cluster, gen: GeneratorConfig) -> list[str]:
    """generator.server_urls and router_url reach SGLang servers and the router, whose
    --worker-urls are those servers."""
    problems = []
    for url, module in [*((u, "sglang.launch_server") for u in gen.server_urls),
                        *([(gen.router_url, "sglang_router.launch_router")] if gen.router_url
                          else [])]:
        found = _serving(cluster, url)
        if isinstance(found, str):
            problems.append(f"streamrl.toml [generator]: {found}")
            continue
        workload = found[0]
        runs = [c for c in containers(workload) if _runs(c, module)]
        if not runs:
            problems.append(f"streamrl.toml [generator]: {url} reaches "
                            f"{workload['kind']}/{workload['metadata']['name']}, which runs "
                            f"no `python3 -m {module}`")
        for c in runs if module.startswith("sglang_router") and gen.server_urls else []:
            argv = [*c.get("command", []), *c.get("args", [])]
            start = argv.index("--worker-urls") + 1 if "--worker-urls" in argv else len(argv)
            workers = [a for a in argv[start:] if a.startswith("http")]
            if sorted(w.rstrip("/") for w in workers) != sorted(
                    u.rstrip("/") for u in gen.server_urls):
                problems.append(f"sglang-router --worker-urls {workers} differ from "
                                f"generator.server_urls {gen.server_urls}")
    return problems


def _vllm_problems(cluster: Cluster, gen: GeneratorConfig) -> list[str]:
    """Every URL of generator.server_urls is a vLLM server on the port vLLM listens on, and
    every vLLM server is in server_urls (there is no router: the generators balance over them
    and reload each version on each), which runs as streamrl's client needs it
    (:func:`_vllm_server_problems`)."""
    if not gen.server_urls:
        return ["streamrl.toml [generator]: engine 'vllm' needs server_urls naming every vLLM "
                "server: each new version is reloaded on each"]
    problems, named = [], set()
    for url in gen.server_urls:
        found = _serving(cluster, url)
        if isinstance(found, str):
            problems.append(f"streamrl.toml [generator]: {found}")
            continue
        workload, svc = found
        where = f"{workload['kind']}/{workload['metadata']['name']}"
        named.add((where, (urlsplit(url).hostname or "").split(".")[0]))
        runs = [c for c in containers(workload) if _is_vllm(c)]
        if not runs:
            problems.append(f"streamrl.toml [generator]: {url} reaches {where}, which runs no "
                            f"vLLM server (`vllm serve`)")
        if runs and workload["kind"] != "StatefulSet" and \
                _get(workload, "spec", "replicas", default=1) != 1:
            problems.append(f"streamrl.toml [generator]: {url}: Service "
                            f"{svc['metadata']['name']!r} balances over the replicas of {where}: "
                            f"a weight reload would reach one of them; name each server (a "
                            f"StatefulSet's pods behind a headless Service)")
        for c in runs:
            argv = [*c.get("command", []), *c.get("args", [])]
            listens = flag(argv, "--port") or str(VLLM_PORT)
            target = _target_port(svc, urlsplit(url).port, c)
            if str(target) != listens:
                problems.append(f"streamrl.toml [generator]: {url}: Service "
                                f"{svc['metadata']['name']!r} sends port {urlsplit(url).port} to "
                                f"{target}, and vLLM listens on {listens} (--port)")
    for r in {id(r): r for r, _ in servers(cluster, "vllm")}.values():
        where, name = f"{r['kind']}/{r['metadata']['name']}", r["metadata"]["name"]
        pods = ([f"{name}-{i}" for i in range(_get(r, "spec", "replicas", default=1))]
                if r["kind"] == "StatefulSet" else [])
        unnamed = [p for p in pods if (where, p) not in named]
        if unnamed or (not pods and not any(w == where for w, _ in named)):
            problems.append(f"{where}: vLLM server(s) {unnamed or [name]} in no URL of "
                            f"generator.server_urls {gen.server_urls}: no generator sends them "
                            f"requests or weights (one URL per pod, "
                            f"http://<pod>.<headless Service>:<port>)")
    for r, c in servers(cluster, "vllm"):
        problems += _vllm_server_problems(cluster, r, c)
    return problems


def _target_port(svc: Resource, port: int | None, container: dict[str, Any]) -> int | None:
    """The container port a Service's ``port`` reaches in ``container``."""
    for entry in _get(svc, "spec", "ports", default=[]):
        if entry.get("port") == port:
            target = entry.get("targetPort", port)
            if isinstance(target, int):
                return target
            return next((p.get("containerPort") for p in container.get("ports", [])
                         if p.get("name") == target), None)
    return None


def _options(argv: Sequence[str]) -> dict[str, str | None]:
    """``--flag value`` and bare ``--flag`` (None) of a command line."""
    return {a: (argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("-") else None)
            for i, a in enumerate(argv) if a.startswith("--")}


def _vllm_server_problems(cluster: Cluster, owner: Resource,
                          container: dict[str, Any]) -> list[str]:
    """The flags and environment streamrl's client needs of every vLLM server
    (``inference/vllm_server.py``: serve_flags, SERVER_ENVIRONMENT; compose and ``streamrl up``
    start it with the same), and its worker extension on PYTHONPATH, from a ConfigMap that
    holds this checkout's ``inference/vllm_ext``."""
    argv = [*container.get("command", []), *container.get("args", [])]
    where = f"{owner['kind']}/{owner['metadata']['name']} ({container['name']})"
    given = {a.partition("=")[0] for a in argv}
    length = flag(argv, "--max-model-len") or ""
    problems = [] if length.isdigit() else [
        f"{where}: no --max-model-len: the batch (--max-num-batched-tokens) must hold the "
        f"longest sequence, every prefill is whole"]
    wanted = _options(serve_flags(max_model_len=int(length or 0),
                                  served_name=flag(argv, "--served-model-name") or "policy"))
    for name, value in wanted.items():
        have = flag(argv, name)
        if name == "--max-num-batched-tokens":
            if length.isdigit() and not (have and have.isdigit() and int(have) >= int(length)):
                problems.append(f"{where}: --max-num-batched-tokens {have} below "
                                f"--max-model-len {length}: with --no-enable-chunked-prefill a "
                                f"prefill is one batch")
        elif (name not in given) if value is None else (have != value):
            problems.append(f"{where}: needs {name}{'' if value is None else ' ' + value}"
                            f"{'' if have is None else f', not {have!r}'} (streamrl's vLLM "
                            f"client: inference/vllm_server.py, serve_flags)")
    env = cluster.env(Process(owner, container))
    for var, value in SERVER_ENVIRONMENT.items():
        if env.get(var) != value:
            problems.append(f"{where}: {var}={env.get(var)!r}, needs {value!r} "
                            f"(inference/vllm_server.py, SERVER_ENVIRONMENT)")
    cls = flag(argv, "--worker-extension-cls") or ""
    module = cls.rpartition(".")[0].replace(".", "/") + ".py"
    path = (env.get("PYTHONPATH") or "").split(":")
    sources = [s for s in (mounted_file(cluster, Process(owner, container),
                                        f"{d.rstrip('/')}/{module}") for d in path if d) if s]
    if not sources:
        return [*problems, f"{where}: no directory of PYTHONPATH {':'.join(path)!r} holds "
                           f"{module} from a ConfigMap: vLLM's workers cannot import {cls}"]
    name, key = sources[0]
    text, ours = (cluster.keys("ConfigMap", name) or {}).get(key), VLLM_EXTENSION / module
    if ours.is_file() and text is not None and text != ours.read_text():
        problems.append(f"{where}: ConfigMap/{name} {key} is not this checkout's "
                        f"inference/vllm_ext/{module}: copy it again")
    return problems


def _claim_of(p: Process | tuple[Resource, dict[str, Any]], path: PurePosixPath) -> \
        tuple[str, str, bool] | None:
    """(claim, mountPath, readOnly) of the PVC mount holding ``path`` in a container."""
    owner, container = (p.owner, p.container) if isinstance(p, Process) else p
    volumes = {v["name"]: v for v in pod_spec(owner).get("volumes", [])}
    for m in container.get("volumeMounts", []):
        claim = _get(volumes, m["name"], "persistentVolumeClaim", "claimName")
        if claim and path.is_relative_to(m["mountPath"]):
            return claim, m["mountPath"], bool(m.get("readOnly"))
    return None


def check_weights(cluster: Cluster, config: Config) -> list[str]:
    """The learner writes each version where every SGLang or vLLM server loads it from (the
    same claim at the same path: the path is what the generators send)."""
    work = PurePosixPath(config.run.path)
    problems = []
    for p in (p for p in _actors(cluster) if p.role == "learner"):
        mine = _claim_of(p, work)
        if mine is None or mine[2]:
            problems.append(f"{p.where}: run.work_dir {work} is on no writable volume claim")
            continue
        for r, c in servers(cluster, config.generator.engine):
            theirs = _claim_of((r, c), work)
            if theirs is None or theirs[:2] != mine[:2]:
                problems.append(f"{r['kind']}/{r['metadata']['name']} ({c['name']}): "
                                f"mount claim {mine[0]} at {mine[1]} as the learner does: "
                                f"each weight version is loaded from {work}")
    return problems


def check_sandbox(cluster: Cluster, config: Config) -> list[str]:
    """The executor pods allow the sandbox streamrl.toml asks for."""
    ex = config.executor
    backends = {ex.backend, *(d.backend for d in ex.domains.values() if d.backend)}
    strongest = "bwrap" if ex.isolation == "auto" else ex.isolation
    problems = []
    if "process" in backends and ISOLATION_LEVELS.index(ex.min_isolation) > \
            ISOLATION_LEVELS.index(strongest):
        problems.append(f"streamrl.toml: executor.min_isolation {ex.min_isolation!r} with the "
                        f"process backend at {strongest!r}: the executor would refuse to start")
    for p in (p for p in _actors(cluster) if p.role == "executor"):
        pod, sc = pod_spec(p.owner), p.container.get("securityContext", {})
        profile = {k: _get(sc, k, "type", default=_get(pod, "securityContext", k, "type"))
                   for k in ("seccompProfile", "appArmorProfile")}
        if "process" in backends and strongest == "bwrap":
            missing = [what for what, ok in (
                ("hostUsers: false", pod.get("hostUsers") is False),
                ("procMount: Unmasked", sc.get("procMount") == "Unmasked"),
                ("an Unconfined or Localhost seccompProfile",
                 profile["seccompProfile"] in ("Unconfined", "Localhost")),
                ("an Unconfined or Localhost appArmorProfile",
                 profile["appArmorProfile"] in ("Unconfined", "Localhost"))) if not ok]
            if missing:
                problems.append(f"{p.where}: bwrap sandboxes (executor.backend 'process') need "
                                f"{', '.join(missing)} (docs/kubernetes.md)")
        if "docker" in backends and "DOCKER_HOST" not in cluster.env(p):
            problems.append(f"{p.where}: the docker backend needs DOCKER_HOST (a socket proxy)")
    return problems


CHECKS: tuple[Callable[[Cluster, Config], list[str]], ...] = (
    check_processes, check_credentials, check_keda, check_learner_and_gpus, check_inference,
    check_weights, check_sandbox,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="check.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", nargs="?", type=Path, default=HERE)
    parser.add_argument("--component", action="append", type=Path, default=[],
                        help="also render this component (a directory), as if listed")
    parser.add_argument("--print", action="store_true", help="print the rendered YAML and exit")
    args = parser.parse_args(argv)
    if args.print:
        print(yaml.safe_dump_all(render(args.directory, args.component), sort_keys=False), end="")
        return 0
    report = check(args.directory, args.component)
    for problem in report.problems:
        print(f"k8s-check: {problem}", file=sys.stderr)
    kinds = sorted({r["kind"] for r in report.resources})
    label = " + ".join(str(p) for p in [args.directory, *args.component])
    if report.problems:
        print(f"k8s-check: {label}: {len(report.problems)} problem(s)", file=sys.stderr)
        return 1
    print(f"k8s-check: {label}: {len(report.resources)} resources ({', '.join(kinds)}): valid "
          f"against Kubernetes {KUBERNETES_VERSION} (strict) and the vendored KEDA schema; "
          f"streamrl's streams, groups, roles, commands and references agree")
    return 0


if __name__ == "__main__":
    sys.exit(main())
