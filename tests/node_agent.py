"""A node-agent twin for tests: it plays the kubelet for the pods of one namespace.

It talks to the same API the operator uses and runs each pod from its spec alone, with the local
installation (.venv) standing in for the image. Two ways to get its pods:

* **On a real API server** (`node=NodeRegistration(...)`, credentials from a kubeconfig): it
  registers a Node (capacity, a Ready condition, its address, a NoSchedule taint that only pods
  tolerating `TWIN_TOLERATION` pass, so that other tests' pods stay Pending) and renews its Lease
  in kube-node-lease every 10 s as a kubelet does (without it the node lifecycle controller marks
  the node's Ready condition Unknown and taints it unreachable after node-monitor-grace-period,
  50 s, and its pods are evicted 300 s later). The real scheduler binds pods to it; the agent
  runs those whose spec.nodeName is its node. `close()` deletes the Node and its Lease.
* **On the KMock emulator** (a plain URL: no scheduler, no graceful deletion), it binds every
  pod of the namespace itself: nodeName and a finalizer when it takes the pod.

What it does with a pod:

* **Network**: one bridge the agent makes on the host, in a private range not routed here; each
  pod gets its own network namespace with a veth on that bridge and a new address (never reused
  while the agent lives, as a replaced pod gets a new IP in a cluster). The host, where the
  operator runs, reaches the pods through the bridge.
* **DNS**: a per-pod hosts file (bind-mounted on /etc/hosts, rewritten in place whenever a pod
  comes or goes) maps `<hostname>.<subdomain>.<ns>.svc[.cluster.local]` of every running pod
  whose subdomain names a Service, and every Service name (`<svc>`, `<svc>.<ns>`,
  `<svc>.<ns>.svc[.cluster.local]`) to the pods it selects (headless Services; there are no
  cluster IPs). The pod's own hostname is its UTS hostname and resolves to its address.
* **Filesystem**: the pod's root is an overlay over the host's / (writes land in a per-pod
  tmpfs), remounted read-only when `readOnlyRootFilesystem` is set; volumes are bind-mounted on
  their mountPaths (resolved inside the pod's root: /var/run -> /run stays in the pod): a
  ConfigMap or Secret as files from the API's object, emptyDir as a fresh directory, hostPath as
  the host directory, a PersistentVolumeClaim as one directory per claim name shared by every
  pod that mounts it (made on first use), a projected volume (the ServiceAccount admission's
  `kube-api-access-*`) as files: a token from the TokenRequest API bound to the pod (not
  refreshed: tests are short), ConfigMap/Secret keys (the cluster's CA from kube-root-ca.crt)
  and downward-API fields. The directories of the interpreter are made traversable in the pod's
  own root (an image has its Python readable by its user).
* **Process**: command + args (with `$(VAR)` expanded) run chrooted in that root, as the
  securityContext's user (the image's user, 1000, when none is given), fsGroup as supplementary
  group, no_new_privs for `allowPrivilegeEscalation: false`, `.venv/bin` first on PATH.
* **Status**: like a kubelet, through the pods/status subresource (field validation Strict on a
  real server): podIP, phase Pending -> Running -> Succeeded/Failed (restartPolicy Never),
  containerStatuses with exitCode and reason, Ready from the readinessProbe (httpGet; a pod
  without one is Ready once running).
* **Deletion**: SIGTERM to the pod's processes, SIGKILL after the grace period, then the pod is
  let go: on a real server a DELETE with gracePeriodSeconds=0 (and the pod's uid as
  precondition), which is what removes a graceful-deleted pod bound to a node; on the emulator
  the finalizer is removed. A pod of the same name with another uid is a new pod (a terminal
  pod is deleted at once, without waiting for the kubelet).

Needs root (namespaces, mounts). `close()` kills every process and removes every namespace,
link and directory the agent made. Not supported: init containers, several containers per
pod, restartPolicy other than Never, probes other than httpGet readiness, cluster IPs.

`python node_agent.py init PLAN.json` is the pod's first process (see `pod_init`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ipaddress
import json
import os
import random
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

FINALIZER = "kubedistill.io/test-node-agent"
NODE_NAME = "twin-node"
"""The node the agent names on the emulator, where it binds pods itself."""
TWIN_TAINT: dict[str, str] = {"key": "kubedistill.io/node-agent-twin", "value": "true", "effect": "NoSchedule"}
TWIN_TOLERATION: dict[str, str] = {**TWIN_TAINT, "operator": "Equal"}
"""What a pod needs to be scheduled on the twin's Node (and what other tests' pods lack)."""
LEASE_NAMESPACE = "kube-node-lease"
LEASE_SECONDS = 40
RENEW_SECONDS = 10.0
"""A kubelet's defaults: the node lifecycle controller sees a node as alive while its Lease is
renewed within node-monitor-grace-period (50 s)."""
VENV_BIN = Path(__file__).resolve().parent.parent / ".venv" / "bin"
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class Image:
    """What the runtime image would give a container that the pod spec does not set
    (images/runtime/Dockerfile: ENV, USER, WORKDIR)."""

    env: Mapping[str, str] = field(
        default_factory=lambda: {"PYTHONUNBUFFERED": "1", "HF_HOME": "/tmp/hf", "VLLM_NO_USAGE_STATS": "1"}
    )
    uid: int = 1000
    gid: int = 1000
    workdir: str = "/home/kubedistill"
    bin_dir: Path = VENV_BIN
    files: tuple[str, ...] = (
        str(VENV_BIN.parent.parent),  # the checkout: .venv and the editable install's sources
        os.path.realpath(sys.base_prefix),  # the interpreter the venv links to
    )
    """Where the installation standing in for the image lives on the host. An image's files are
    its root filesystem, never under a pod volume: they stay visible even where a volume is
    mounted over a parent (the restricted defaults' /tmp emptyDir over a checkout in /tmp)."""


@dataclass(frozen=True)
class ApiAccess:
    """Where the API server is and how to authenticate to it."""

    server: str
    ssl_context: ssl.SSLContext | None = None
    headers: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def plain(cls, url: str) -> ApiAccess:
        """Plain HTTP, no credentials: the KMock emulator."""
        return cls(server=url.rstrip("/"))

    @classmethod
    def from_kubeconfig(cls, path: Path) -> ApiAccess:
        """The current context of a kubeconfig: its CA, client certificate or bearer token."""
        from kubernetes import client, config

        cfg = client.Configuration()
        # kubernetes ships py.typed but leaves its config loaders unannotated.
        config.load_kube_config(config_file=str(path), client_configuration=cfg)  # type: ignore[no-untyped-call]
        ctx: ssl.SSLContext | None = None
        if cfg.host.startswith("https"):
            ctx = ssl.create_default_context(cafile=cfg.ssl_ca_cert)
            if cfg.cert_file:
                ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
        # The client keeps a kubeconfig's token under "BearerToken" (since 36.0.1).
        auth = cfg.auth_settings().get("BearerToken")
        token = auth.get("value") if auth else None
        headers: dict[str, str] = {"Authorization": str(token)} if token else {}
        return cls(server=cfg.host.rstrip("/"), ssl_context=ctx, headers=headers)


def _meminfo_kib() -> int:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1])
    return 8 * 1024 * 1024


@dataclass(frozen=True)
class NodeRegistration:
    """The Node the agent registers on a real API server for the scheduler to bind pods to."""

    name: str = field(default_factory=lambda: f"node-agent-twin-{random.randrange(16**6):06x}")
    taints: tuple[Mapping[str, str], ...] = (TWIN_TAINT,)
    cpu: str = field(default_factory=lambda: str(os.cpu_count() or 1))
    memory: str = field(default_factory=lambda: f"{_meminfo_kib()}Ki")
    pods: int = 110
    labels: Mapping[str, str] = field(default_factory=dict)

    def body(self, address: str, kubelet_version: str) -> dict[str, Any]:
        """The Node object, status included (the API server keeps a Node's status on create)."""
        now = now_rfc3339()
        resources = {"cpu": self.cpu, "memory": self.memory, "pods": str(self.pods)}

        def condition(kind: str, status: str, reason: str) -> dict[str, str]:
            return {"type": kind, "status": status, "reason": reason, "message": "node-agent twin",
                    "lastHeartbeatTime": now, "lastTransitionTime": now}  # fmt: skip

        labels = {
            "kubernetes.io/hostname": self.name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": {"x86_64": "amd64", "aarch64": "arm64"}.get(os.uname().machine, os.uname().machine),
            **self.labels,
        }
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": self.name, "labels": labels},
            "spec": {"taints": [dict(t) for t in self.taints]},
            "status": {
                "capacity": resources,
                "allocatable": resources,
                "conditions": [
                    condition("Ready", "True", "KubeletReady"),
                    condition("MemoryPressure", "False", "KubeletHasSufficientMemory"),
                    condition("DiskPressure", "False", "KubeletHasNoDiskPressure"),
                    condition("PIDPressure", "False", "KubeletHasSufficientPID"),
                ],
                "addresses": [{"type": "InternalIP", "address": address}, {"type": "Hostname", "address": self.name}],
                "nodeInfo": {
                    "kubeletVersion": kubelet_version,
                    "operatingSystem": "linux",
                    "architecture": labels["kubernetes.io/arch"],
                    "kernelVersion": os.uname().release,
                    "containerRuntimeVersion": "node-agent-twin://0",
                    "osImage": "node-agent-twin",
                    "machineID": "",
                    "systemUUID": "",
                    "bootID": "",
                    "kubeProxyVersion": "",
                },
            },
        }


class PodStartError(Exception):
    """The pod cannot start yet: (kubelet waiting reason, message)."""

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    """A MicroTime (a Lease's renewTime)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# -- pure pieces (unit-tested) ---------------------------------------------------------------

_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: a defined variable is replaced, an undefined reference
    stays as written, `$$` is a literal `$`."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR_REF.sub(sub, text)


def field_ref(pod: Mapping[str, Any], path: str, pod_ip: str) -> str:
    meta = pod.get("metadata") or {}
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": (pod.get("spec") or {}).get("nodeName") or NODE_NAME,
        "spec.serviceAccountName": (pod.get("spec") or {}).get("serviceAccountName", "default"),
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": pod_ip,
    }
    if path in simple:
        return str(simple[path])
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if m:
        return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
    raise PodStartError("CreateContainerConfigError", f"unsupported fieldRef {path!r}")


Lookup = Callable[[str], Mapping[str, str] | None]
"""ConfigMap or Secret name -> its (decoded) data; None when it does not exist."""


def _key_ref(kind: str, ref: Mapping[str, Any], lookup: Lookup) -> str | None:
    data = lookup(str(ref.get("name", "")))
    key = str(ref.get("key", ""))
    if data is None or key not in data:
        if ref.get("optional"):
            return None
        what = f"{kind} {ref.get('name')!r}" if data is None else f"key {key!r} of {kind} {ref.get('name')!r}"
        raise PodStartError("CreateContainerConfigError", f"{what} not found")
    return data[key]


def resolve_env(
    pod: Mapping[str, Any],
    container: Mapping[str, Any],
    pod_ip: str,
    config_maps: Lookup,
    secrets: Lookup,
    image: Image = Image(),
) -> dict[str, str]:
    """The container's environment: the image's, then the pod's `env` in order (values with
    `$(VAR)` expanded against the variables before them, fieldRef, configMapKeyRef,
    secretKeyRef), then HOSTNAME; PATH starts with the stand-in image's bin directory."""
    env: dict[str, str] = {"PATH": f"{image.bin_dir}:{SYSTEM_PATH}", **image.env}
    for e in container.get("env") or []:
        name = e["name"]
        source = e.get("valueFrom")
        if source is None:
            env[name] = expand(str(e.get("value", "")), env)
            continue
        value: str | None
        if "fieldRef" in source:
            value = field_ref(pod, source["fieldRef"]["fieldPath"], pod_ip)
        elif "configMapKeyRef" in source:
            value = _key_ref("ConfigMap", source["configMapKeyRef"], config_maps)
        elif "secretKeyRef" in source:
            value = _key_ref("Secret", source["secretKeyRef"], secrets)
        else:
            raise PodStartError("CreateContainerConfigError", f"env {name}: unsupported valueFrom {sorted(source)}")
        if value is not None:
            env[name] = value
    spec = pod.get("spec") or {}
    env.setdefault("HOSTNAME", spec.get("hostname") or (pod.get("metadata") or {}).get("name", ""))
    return env


def container_argv(container: Mapping[str, Any], env: Mapping[str, str]) -> list[str]:
    argv = [expand(str(a), env) for a in [*(container.get("command") or []), *(container.get("args") or [])]]
    if not argv:
        raise PodStartError("CreateContainerConfigError", "no command: the stand-in image has no default one")
    return argv


def named_port(container: Mapping[str, Any], port: int | str) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"container has no port named {port!r}")


@dataclass(frozen=True)
class PodAddress:
    """A running pod as the DNS twin sees it."""

    name: str
    ip: str
    hostname: str
    subdomain: str | None
    labels: Mapping[str, str]


def selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def hosts_file(me: PodAddress, pods: list[PodAddress], services: Mapping[str, Mapping[str, str]], ns: str) -> str:
    """/etc/hosts of pod `me`: what cluster DNS would answer, for every running pod of the
    namespace (`services`: Service name -> selector)."""
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]

    def fqdn(p: PodAddress) -> list[str]:
        if p.subdomain and p.subdomain in services:
            base = f"{p.hostname}.{p.subdomain}.{ns}.svc"
            return [f"{base}.cluster.local", base]
        return []

    # The pod's own names first: Kubernetes writes them into every pod's /etc/hosts.
    lines.append("\t".join([me.ip, *fqdn(me), me.hostname]))
    for p in sorted(pods, key=lambda p: p.name):
        if p.name != me.name and fqdn(p):
            lines.append("\t".join([p.ip, *fqdn(p)]))
    for svc, selector in sorted(services.items()):
        names = [f"{svc}.{ns}.svc.cluster.local", f"{svc}.{ns}.svc", f"{svc}.{ns}", svc]
        for p in sorted(pods, key=lambda p: p.name):
            if selects(selector, p.labels):
                lines.append("\t".join([p.ip, *names]))
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Mount:
    source: str
    target: str
    read_only: bool


def security(pod: Mapping[str, Any], container: Mapping[str, Any], image: Image) -> dict[str, Any]:
    """uid, gid, supplementary groups, read-only root, no_new_privs of the container."""
    psc = (pod.get("spec") or {}).get("securityContext") or {}
    csc = container.get("securityContext") or {}
    uid = csc.get("runAsUser", psc.get("runAsUser", image.uid))
    gid = csc.get("runAsGroup", psc.get("runAsGroup", image.gid))
    if csc.get("runAsNonRoot", psc.get("runAsNonRoot")) and uid == 0:
        raise PodStartError("CreateContainerConfigError", "container has runAsNonRoot and would run as root")
    groups = [g for g in [psc.get("fsGroup"), *(psc.get("supplementalGroups") or [])] if g is not None]
    return {
        "uid": int(uid),
        "gid": int(gid),
        "groups": sorted({int(g) for g in groups}),
        "read_only_root": bool(csc.get("readOnlyRootFilesystem", False)),
        "no_new_privs": csc.get("allowPrivilegeEscalation") is False,
        "fs_group": psc.get("fsGroup"),
    }


def container_status(
    name: str, image: str, state: str, *, ready: bool, started: str | None, exit_code: int | None = None
) -> dict[str, Any]:
    """One containerStatuses entry: state waiting (with a reason), running or terminated."""
    if state == "running":
        st: dict[str, Any] = {"running": {"startedAt": started}}
    elif state == "terminated":
        assert exit_code is not None
        st = {
            "terminated": {
                "exitCode": exit_code,
                "reason": "Completed" if exit_code == 0 else "Error",
                "startedAt": started,
                "finishedAt": now_rfc3339(),
            }
        }
    else:
        st = {"waiting": {"reason": state}}
    return {
        "name": name,
        "image": image,
        "imageID": "",
        "ready": ready,
        "started": state == "running",
        "restartCount": 0,
        "state": st,
    }


def exit_code_of(returncode: int) -> int:
    """Popen's returncode as a container runtime reports it (a signal N is 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


# -- the pod's first process ----------------------------------------------------------------


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True)


def covered_by_volumes(paths: list[str], targets: list[str]) -> list[str]:
    """The `paths` that a volume mounted at one of `targets` (or a parent of one) would hide."""
    tops = [t.rstrip("/") or "/" for t in targets]
    return [p for p in paths if any(p == t or p.startswith(t.rstrip("/") + "/") for t in tops)]


def in_root(root: str, path: str) -> str:
    """The host path of `path` as a process chrooted in `root` sees it: symlinks on the way are
    followed inside `root` (an absolute target starts again at `root`, `..` stops there), so that
    a mount on the image's /var/run/... (-> /run) lands in the pod's /run, not the host's.
    Components that do not exist yet are appended as they are."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    resolved = root.rstrip("/") or "/"
    hops = 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            if resolved != root.rstrip("/"):
                resolved = os.path.dirname(resolved)
            continue
        candidate = os.path.join(resolved, part)
        if not os.path.islink(candidate):
            resolved = candidate
            continue
        hops += 1
        if hops > 40:  # as the kernel gives up (ELOOP)
            raise OSError(f"too many levels of symbolic links under {root}: {path}")
        target = os.readlink(candidate)
        if target.startswith("/"):
            resolved = root.rstrip("/") or "/"
        parts = [p for p in target.split("/") if p not in ("", ".")] + parts
    return resolved


def pod_init(plan: Mapping[str, Any]) -> None:
    """Run as root inside the pod's new network, mount and UTS namespaces (nsenter + unshare):
    build the pod's root, mount its volumes, drop to its user and exec its command."""
    stage = plan["stage"]
    _run("mount", "-t", "tmpfs", "-o", "mode=755", "pod-root", stage)
    upper, work, root = (os.path.join(stage, d) for d in ("upper", "work", "root"))
    for d in (upper, work, root):
        os.mkdir(d)
    _run("mount", "-t", "overlay", "overlay", "-o", f"lowerdir=/,upperdir={upper},workdir={work}", root)
    for d in ("dev", "proc", "sys"):
        _run("mount", "--rbind", f"/{d}", f"{root}/{d}")
    for m in sorted(plan["mounts"], key=lambda m: m["target"].count("/")):
        target = in_root(root, m["target"])
        if os.path.isdir(m["source"]):
            os.makedirs(target, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if not os.path.exists(target):
                open(target, "a").close()
        _run("mount", "--bind", m["source"], target)
        if m["read_only"]:
            _run("mount", "-o", "remount,bind,ro", target)
    for path in covered_by_volumes(plan["image_files"], [m["target"] for m in plan["mounts"]]):
        os.makedirs(in_root(root, path), exist_ok=True)
        _run("mount", "--rbind", path, in_root(root, path))
    # An image makes its programs readable by its user; here they may live under /root or a
    # pytest directory (0700): open up their directories in the pod's own root.
    for path in (plan["bin_dir"], os.path.realpath(os.path.join(plan["bin_dir"], "python"))):
        d = os.path.dirname(path + "/")
        while d != "/":
            st = os.stat(root + d)
            os.chmod(root + d, st.st_mode | 0o005)
            d = os.path.dirname(d)
    os.makedirs(root + plan["workdir"], exist_ok=True)
    os.chown(root + plan["workdir"], plan["uid"], plan["gid"])
    socket.sethostname(plan["hostname"])
    if plan["read_only_root"]:
        _run("mount", "-o", "remount,bind,ro", root)
    os.chroot(root)
    os.chdir(plan["workdir"])
    if plan["no_new_privs"]:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
    os.setgroups(plan["groups"])
    os.setgid(plan["gid"])
    os.setuid(plan["uid"])
    os.umask(0o022)
    try:
        os.execvpe(plan["argv"][0], plan["argv"], plan["env"])
    except OSError as e:
        print(f"node-agent: cannot run {plan['argv'][0]}: {e}", file=sys.stderr, flush=True)
        os._exit(127)


# -- the network -----------------------------------------------------------------------------


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def _routed() -> list[ipaddress.IPv4Network]:
    out = _ip("-4", "route", "show", "table", "all").stdout
    nets = []
    for line in out.splitlines():
        first = line.split()[0] if line.split() else ""
        with contextlib.suppress(ValueError):
            if first not in ("default", "broadcast", "local") and "/" in first:
                nets.append(ipaddress.IPv4Network(first, strict=False))
    return nets


class Network:
    """A bridge in a private /24 nothing on the host routes yet, and veth-linked pod netns."""

    def __init__(self) -> None:
        self.tag = f"{random.randrange(16**6):06x}"
        self.bridge = f"kdn{self.tag}"
        routed = _routed()
        rng = random.Random()
        for _ in range(100):
            net = ipaddress.IPv4Network(f"10.{rng.randrange(200, 250)}.{rng.randrange(256)}.0/24")
            if not any(net.overlaps(r) for r in routed):
                break
        else:
            raise RuntimeError("no free private /24 for the node agent's bridge")
        self.net = net
        hosts = list(net.hosts())
        self.gateway = str(hosts[0])
        self._free = [str(h) for h in hosts[1:]]
        self.namespaces: dict[str, str] = {}
        """Pod network namespace -> the host's end of its veth."""
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/{net.prefixlen}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def add_pod(self) -> tuple[str, str]:
        """A new network namespace wired to the bridge: (its name, its address)."""
        if not self._free:
            raise PodStartError("NetworkNotReady", "the node agent ran out of pod addresses")
        ip = self._free.pop(0)
        host_if = f"kdv{self.tag}{ip.rsplit('.', 1)[1]}"[:15]
        ns = f"kdpod-{self.tag}-{ip.rsplit('.', 1)[1]}"
        _ip("netns", "add", ns)
        self.namespaces[ns] = host_if
        _ip("link", "add", host_if, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", host_if, "master", self.bridge, "up")
        _ip("-n", ns, "addr", "add", f"{ip}/{self.net.prefixlen}", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "route", "add", "default", "via", self.gateway)
        return ns, ip

    def remove_pod(self, ns: str) -> None:
        # Deleting the namespace deletes its veth end, and with it the host's, once nothing holds
        # the namespace any more: delete the host's end too, so that no link outlives the test.
        _ip("netns", "del", ns, check=False)
        host_if = self.namespaces.pop(ns, None)
        if host_if is not None:
            _ip("link", "del", host_if, check=False)

    def close(self) -> None:
        for ns in list(self.namespaces):
            self.remove_pod(ns)
        _ip("link", "del", self.bridge, check=False)


# -- the agent -------------------------------------------------------------------------------


@dataclass
class PodRun:
    """One pod the agent took."""

    name: str
    uid: str
    body: dict[str, Any]
    dir: Path
    log: Path
    ns: str | None = None
    ip: str | None = None
    proc: subprocess.Popen[bytes] | None = None
    started: str | None = None
    exit_code: int | None = None
    ready: bool = False
    waiting: tuple[str, str] | None = None
    probe_at: float = 0.0
    probe_failures: int = 0
    kill_at: float | None = None
    reported: dict[str, Any] | None = None
    hosts: Path | None = None
    retry_at: float = 0.0

    @property
    def container(self) -> dict[str, Any]:
        containers: list[dict[str, Any]] = self.body["spec"]["containers"]
        return containers[0]

    @property
    def running(self) -> bool:
        return self.proc is not None and self.exit_code is None


class ApiError(Exception):
    """The API server refused a request: HTTP status and its Status message."""

    def __init__(self, status: int, method: str, url: str, message: str):
        super().__init__(f"{method} {url}: HTTP {status}: {message}")
        self.status = status


class NodeAgent:
    """Plays the kubelet for the pods of `namespace` on the API server `api` (a plain URL: the
    emulator; or ApiAccess, e.g. from a kubeconfig). With `node` it registers that Node and runs
    the pods the scheduler binds to it; without, it binds every pod of the namespace itself (the
    emulator has no scheduler). `async with NodeAgent(...)` starts and closes it."""

    def __init__(
        self,
        api: str | ApiAccess,
        namespace: str,
        *,
        node: NodeRegistration | None = None,
        image: Image = Image(),
        poll_seconds: float = 0.2,
        probe_period_max: float | None = None,
        base: Path | None = None,
    ):
        self.api = ApiAccess.plain(api) if isinstance(api, str) else api
        self.server = self.api.server
        self.namespace = namespace
        self.node = node
        self.image = image
        self.poll_seconds = poll_seconds
        self.probe_period_max = probe_period_max
        self.base = Path(tempfile.mkdtemp(prefix="node-agent-", dir=base))
        self.logs = self.base / "logs"
        self.logs.mkdir()
        self.pods: dict[str, PodRun] = {}
        self.history: list[PodRun] = []
        """Every pod run, newest last (the test reads logs and exit codes from it)."""
        self.network: Network | None = None
        self._task: asyncio.Task[None] | None = None
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._http: Any = None
        self._services: dict[str, dict[str, str]] = {}
        self._hosts_table: tuple[Any, ...] | None = None
        self.errors: list[str] = []
        self._cache: dict[tuple[str, str], dict[str, str] | None] = {}
        self._registered = False

    @property
    def node_name(self) -> str:
        return self.node.name if self.node is not None else NODE_NAME

    # -- lifecycle ----------------------------------------------------------------------------
    async def __aenter__(self) -> NodeAgent:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self, ready_timeout: float = 60.0) -> None:
        """Make the bridge; on a real server register the Node, start renewing its Lease and
        wait until the scheduler may use it (the node lifecycle controller lifts the
        `node.kubernetes.io/not-ready` taint the API server puts on a new Node)."""
        import aiohttp

        try:
            self.network = await asyncio.to_thread(Network)
            connector = aiohttp.TCPConnector(ssl=self.api.ssl_context or False)
            self._http = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=10))
            if self.node is not None:
                await self._register()
                self._heartbeat_task = asyncio.create_task(self._heartbeat())
                await self._until_schedulable(ready_timeout)
        except BaseException:
            await self.close()  # no bridge or Node left behind by a start that did not finish
            raise
        self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        """Kill every pod process, remove every namespace, link and directory made here, and on
        a real server the Node and its Lease."""
        for task in (self._task, self._heartbeat_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        for run in list(self.pods.values()):
            self._signal(run, signal.SIGKILL)
            if run.proc is not None:
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(run.proc.wait, 10)
            self._teardown(run)
        self.pods.clear()
        if self._registered and self.node is not None:
            with contextlib.suppress(Exception):
                await self._request("DELETE", self._lease_url())
            with contextlib.suppress(Exception):
                await self._request("DELETE", f"{self.server}/api/v1/nodes/{self.node.name}")
        if self.network is not None:
            await asyncio.to_thread(self.network.close)
        if self._http is not None:
            await self._http.close()
        shutil.rmtree(self.base, ignore_errors=True)

    # -- what tests use ---------------------------------------------------------------------
    def claim_dir(self, claim: str) -> Path:
        """The directory that backs PersistentVolumeClaim `claim`."""
        return self.base / "claims" / claim

    def pid(self, pod: str) -> int | None:
        run = self.pods.get(pod)
        return run.proc.pid if run is not None and run.running and run.proc is not None else None

    def log_tail(self, lines: int = 30) -> str:
        out = []
        for run in self.history:
            with contextlib.suppress(OSError):
                tail = run.log.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- {run.log.name} (exit {run.exit_code}) ---\n" + "\n".join(tail))
        return "\n".join(out + [f"node agent error: {e}" for e in self.errors])

    # -- API ------------------------------------------------------------------------------------
    def _path(self, kind: str, name: str = "") -> str:
        path = f"{self.server}/api/v1/namespaces/{self.namespace}/{kind}"
        return f"{path}/{name}" if name else path

    async def _request(
        self,
        method: str,
        url: str,
        body: Mapping[str, Any] | None = None,
        *,
        content_type: str = "application/json",
        params: Mapping[str, str] | None = None,
    ) -> Any:
        """The response's JSON; None for 404 (gone is as good as deleted to a kubelet)."""
        headers = {"Accept": "application/json", **self.api.headers}
        if body is not None:
            headers["Content-Type"] = content_type
        if method in ("POST", "PUT", "PATCH") and self.node is not None:
            # As kubectl asks: an unknown or misspelt field is an error, not a warning.
            params = {"fieldValidation": "Strict", **(params or {})}
        data = json.dumps(body) if body is not None else None
        async with self._http.request(method, url, data=data, headers=headers, params=params) as r:
            if r.status == 404:
                return None
            if r.status >= 400:
                text = await r.text()
                with contextlib.suppress(ValueError, AttributeError):
                    text = json.loads(text).get("message") or text
                raise ApiError(r.status, method, url, text)
            text = await r.text()
            return json.loads(text) if text.strip() else {}

    async def _get(self, url: str, params: Mapping[str, str] | None = None) -> Any:
        return await self._request("GET", url, params=params)

    async def _patch(self, url: str, body: Mapping[str, Any]) -> bool:
        return await self._request("PATCH", url, body, content_type="application/merge-patch+json") is not None

    async def _data(self, kind: str, name: str) -> dict[str, str] | None:
        obj = await self._get(self._path(kind, name))
        if obj is None:
            return None
        data = dict(obj.get("data") or {})
        if kind == "secrets":
            data = {k: base64.b64decode(v).decode() for k, v in data.items()}
            data.update(obj.get("stringData") or {})
        else:
            data.update({k: base64.b64decode(v).decode("latin-1") for k, v in (obj.get("binaryData") or {}).items()})
        return data

    # -- the Node -------------------------------------------------------------------------------
    def _lease_url(self) -> str:
        return f"{self.server}/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases/{self.node_name}"

    async def _register(self) -> None:
        assert self.node is not None and self.network is not None
        version = (await self._get(f"{self.server}/version") or {}).get("gitVersion", "v0.0.0")
        created = await self._request(
            "POST", f"{self.server}/api/v1/nodes", self.node.body(self.network.gateway, version)
        )
        self._registered = True
        # Owned by the Node, as a kubelet makes it: the garbage collector removes it with the Node.
        owner = {"apiVersion": "v1", "kind": "Node", "name": self.node.name, "uid": created["metadata"]["uid"]}
        lease = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": self.node.name, "namespace": LEASE_NAMESPACE, "ownerReferences": [owner]},
            "spec": {"holderIdentity": self.node.name, "leaseDurationSeconds": LEASE_SECONDS, "renewTime": now_micro()},
        }
        url = f"{self.server}/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases"
        await self._request("POST", url, lease)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(RENEW_SECONDS)
            try:
                await self._patch(self._lease_url(), {"spec": {"renewTime": now_micro()}})
            except asyncio.CancelledError:
                raise
            except Exception as e:  # try again next period, as a kubelet does
                self.errors.append(f"lease renewal: {type(e).__name__}: {e}")

    async def _until_schedulable(self, timeout: float) -> None:
        assert self.node is not None
        deadline = time.monotonic() + timeout
        taints: list[Any] = []
        while time.monotonic() < deadline:
            node = await self._get(f"{self.server}/api/v1/nodes/{self.node.name}") or {}
            taints = (node.get("spec") or {}).get("taints") or []
            if not any(str(t.get("key", "")).startswith("node.kubernetes.io/") for t in taints):
                return
            await asyncio.sleep(0.2)
        raise RuntimeError(
            f"node {self.node.name} still has taints {taints} after {timeout} s: the node lifecycle "
            "controller (kube-controller-manager) lifts node.kubernetes.io/not-ready"
        )

    # -- the loop -------------------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            try:
                await self._tick()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # keep playing the kubelet; the test sees the error in its logs
                self.errors.append(f"{type(e).__name__}: {e}")
            await asyncio.sleep(self.poll_seconds)

    async def _tick(self) -> None:
        # A kubelet watches the pods bound to its node; on the emulator every pod is ours to bind.
        selector = {"fieldSelector": f"spec.nodeName={self.node.name}"} if self.node is not None else None
        listed = (await self._get(self._path("pods"), selector))["items"]
        services = (await self._get(self._path("services")))["items"]
        self._services = {
            s["metadata"]["name"]: dict((s.get("spec") or {}).get("selector") or {})
            for s in services
            if (s.get("spec") or {}).get("selector")
        }
        seen = set()
        for pod in listed:
            meta = pod["metadata"]
            name = meta["name"]
            seen.add(name)
            run = self.pods.get(name)
            if run is not None and meta.get("uid") and meta["uid"] != run.uid:
                # The pod we ran is gone (a terminal pod is deleted at once) and a new one took
                # its name between two polls.
                self._forget(run)
                run = None
            if run is None:
                if meta.get("deletionTimestamp"):
                    await self._release(name, meta.get("uid"), meta.get("finalizers") or [])
                    continue
                run = await self._take(pod)
                if run is None:
                    continue
            run.body = pod
            if meta.get("deletionTimestamp"):
                await self._terminate(run)
            elif run.proc is None and run.exit_code is None and time.monotonic() >= run.retry_at:
                await self._start(run)
        for name in set(self.pods) - seen:  # deleted without us (a terminal pod, a force delete)
            self._forget(self.pods[name])
        for run in list(self.pods.values()):
            self._reap(run)
        await self._probe_all()
        self._write_hosts()
        for run in list(self.pods.values()):
            if run.name in self.pods:
                await self._report(run)

    def _forget(self, run: PodRun) -> None:
        """The pod object is gone: nothing to report or wait for, its processes go now."""
        self.pods.pop(run.name, None)
        self._signal(run, signal.SIGKILL)
        self._teardown(run)

    async def _take(self, pod: dict[str, Any]) -> PodRun | None:
        """A pod to run: on the emulator, bind it to this node and hold it with a finalizer
        until its processes are gone (a real server's graceful deletion does that for a bound
        pod, and its nodeName is the scheduler's to set)."""
        meta = pod["metadata"]
        # The emulator gives objects no uid; a kubelet never sets one (kopf indexes pods by
        # namespace, name and uid: a uid appearing mid-life would leave a ghost entry behind).
        uid = meta.get("uid") or str(uuid.uuid4())
        if self.node is None:
            patch = {
                "metadata": {"finalizers": [*(meta.get("finalizers") or []), FINALIZER]},
                "spec": {"nodeName": NODE_NAME},
            }
            if not await self._patch(self._path("pods", meta["name"]), patch):
                return None
        d = self.base / "pods" / f"{meta['name']}-{uid[:8]}"
        (d / "stage").mkdir(parents=True)
        run = PodRun(name=meta["name"], uid=uid, body=pod, dir=d, log=self.logs / f"{meta['name']}-{uid[:8]}.log")
        self.pods[run.name] = run
        self.history.append(run)
        return run

    async def _release(self, name: str, uid: str | None, finalizers: list[str] | None = None) -> None:
        """Let the API server drop a deleted pod whose processes are gone."""
        if self.node is not None:
            # What a kubelet does last: the pod object goes now. The uid precondition keeps a new
            # pod of the same name (409 Conflict) from being deleted in its place.
            options: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0}
            if uid:
                options["preconditions"] = {"uid": uid}
            try:
                await self._request("DELETE", self._path("pods", name), options)
            except ApiError as e:
                if e.status != 409:
                    raise
            return
        if finalizers is not None and FINALIZER not in finalizers:
            return
        pod = await self._get(self._path("pods", name))
        if pod is None:
            return
        rest = [f for f in pod["metadata"].get("finalizers") or [] if f != FINALIZER]
        await self._patch(self._path("pods", name), {"metadata": {"finalizers": rest}})

    async def _start(self, run: PodRun) -> None:
        try:
            await self._start_or_raise(run)
        except PodStartError as e:
            run.waiting = (e.reason, e.message)
            run.retry_at = time.monotonic() + 1.0
            if run.ns is not None and self.network is not None:
                self.network.remove_pod(run.ns)
                run.ns = run.ip = None

    async def _start_or_raise(self, run: PodRun) -> None:
        assert self.network is not None
        pod, c = run.body, run.container
        sec = security(pod, c, self.image)
        mounts = await self._volumes(run, sec)
        if run.ns is None:
            run.ns, run.ip = await asyncio.to_thread(self.network.add_pod)
        assert run.ip is not None
        env = resolve_env(
            pod,
            c,
            run.ip,
            lambda n: self._cache.get(("configmaps", n)),
            lambda n: self._cache.get(("secrets", n)),
            self.image,
        )
        argv = container_argv(c, env)
        run.hosts = run.dir / "hosts"
        run.hosts.write_text(self._hosts_for(run))
        spec = pod["spec"]
        plan = {
            "stage": str(run.dir / "stage"),
            "mounts": [m.__dict__ for m in [*mounts, Mount(str(run.hosts), "/etc/hosts", True)]],
            "hostname": spec.get("hostname") or run.name,
            "workdir": c.get("workingDir") or self.image.workdir,
            "bin_dir": str(self.image.bin_dir),
            "image_files": list(self.image.files),
            "argv": argv,
            "env": env,
            **{k: sec[k] for k in ("uid", "gid", "groups", "read_only_root", "no_new_privs")},
        }
        (run.dir / "plan.json").write_text(json.dumps(plan))
        init = [
            "nsenter",
            f"--net=/run/netns/{run.ns}",
            "unshare",
            "--mount",
            "--uts",
            "--propagation",
            "private",
            sys.executable,
            str(Path(__file__).resolve()),
            "init",
            str(run.dir / "plan.json"),
        ]
        with run.log.open("ab") as log:
            run.proc = subprocess.Popen(init, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        run.started = now_rfc3339()
        run.waiting = None
        probe = c.get("readinessProbe")
        run.probe_at = time.monotonic() + float((probe or {}).get("initialDelaySeconds", 0))
        run.ready = probe is None

    async def _volumes(self, run: PodRun, sec: Mapping[str, Any]) -> list[Mount]:
        """Materialise the pod's volumes; the bind mounts of the container's volumeMounts."""
        self._cache = {}
        c = run.container
        for e in c.get("env") or []:
            src = e.get("valueFrom") or {}
            for kind, key in (("configmaps", "configMapKeyRef"), ("secrets", "secretKeyRef")):
                if key in src:
                    self._cache[(kind, src[key]["name"])] = await self._data(kind, src[key]["name"])
        sources: dict[str, tuple[str, bool]] = {}
        for v in run.body["spec"].get("volumes") or []:
            name = v["name"]
            vdir = run.dir / "volumes" / name
            if "emptyDir" in v:
                vdir.mkdir(parents=True, exist_ok=True)
                vdir.chmod(0o777)  # as the kubelet makes an emptyDir
                sources[name] = (str(vdir), False)
            elif "configMap" in v or "secret" in v:
                await self._key_files(vdir, v, 0o644)
                sources[name] = (str(vdir), True)  # the kubelet mounts these read-only
            elif "projected" in v:
                vdir.mkdir(parents=True, exist_ok=True)
                mode = v["projected"].get("defaultMode", 0o644)
                for src in v["projected"].get("sources") or []:
                    await self._projected(run, vdir, src, mode)
                sources[name] = (str(vdir), True)
            elif "hostPath" in v:
                hp = Path(v["hostPath"]["path"])
                if v["hostPath"].get("type") == "DirectoryOrCreate":
                    hp.mkdir(parents=True, exist_ok=True)
                elif not hp.exists():
                    raise PodStartError("ContainerCreating", f"hostPath {hp} does not exist")
                sources[name] = (str(hp), False)
            elif "persistentVolumeClaim" in v:
                claim = self.claim_dir(v["persistentVolumeClaim"]["claimName"])
                if not claim.exists():
                    claim.mkdir(parents=True)
                    fs_group = sec.get("fs_group")
                    if fs_group is not None:  # what fsGroup does to a volume: group-owned, setgid
                        os.chown(claim, 0, int(fs_group))
                        claim.chmod(0o2775)
                    else:
                        claim.chmod(0o777)
                ro = bool(v["persistentVolumeClaim"].get("readOnly"))
                sources[name] = (str(claim), ro)
            else:
                kinds = sorted(k for k in v if k != "name")
                raise PodStartError("ContainerCreating", f"volume {name}: unsupported source {kinds}")
        mounts = []
        for vm in c.get("volumeMounts") or []:
            if vm["name"] not in sources:
                raise PodStartError("CreateContainerConfigError", f"volumeMount {vm['name']!r} names no volume")
            src, forced_ro = sources[vm["name"]]
            if vm.get("subPath"):
                src = os.path.join(src, vm["subPath"])
                os.makedirs(src, exist_ok=True)
            mounts.append(Mount(src, vm["mountPath"], forced_ro or bool(vm.get("readOnly"))))
        return mounts

    async def _key_files(self, vdir: Path, source: Mapping[str, Any], default_mode: int) -> None:
        """A `configMap` or `secret` volume (or projected source): its keys (or `items`) as files."""
        kind, ref = ("configmaps", source["configMap"]) if "configMap" in source else ("secrets", source["secret"])
        obj_name = ref.get("name") or ref.get("secretName")
        data = await self._data(kind, obj_name)
        if data is None:
            if not ref.get("optional"):
                raise PodStartError("ContainerCreating", f"{kind[:-1]} {obj_name!r} not found")
            data = {}
        items = ref.get("items") or [{"key": k, "path": k} for k in data]
        vdir.mkdir(parents=True, exist_ok=True)
        for it in items:
            if it["key"] not in data:
                if ref.get("optional"):
                    continue
                raise PodStartError("ContainerCreating", f"key {it['key']!r} of {kind[:-1]} {obj_name!r} not found")
            self._write_file(vdir / it["path"], data[it["key"]], it.get("mode", ref.get("defaultMode", default_mode)))

    @staticmethod
    def _write_file(path: Path, text: str, mode: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(mode)

    async def _projected(self, run: PodRun, vdir: Path, src: Mapping[str, Any], mode: int) -> None:
        """One source of a projected volume (what the ServiceAccount admission plugin adds as
        kube-api-access-*: a token, the cluster's CA, the namespace)."""
        if "configMap" in src or "secret" in src:
            await self._key_files(vdir, src, mode)
        elif "serviceAccountToken" in src:
            sat = src["serviceAccountToken"]
            meta, spec = run.body["metadata"], run.body["spec"]
            sa = spec.get("serviceAccountName") or "default"
            request: dict[str, Any] = {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {
                    "audiences": [sat["audience"]] if sat.get("audience") else [],
                    "expirationSeconds": int(sat.get("expirationSeconds", 3600)),
                    # Bound to the pod, as the kubelet asks: the token dies with it.
                    "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]},
                },
            }
            answer = await self._request("POST", self._path("serviceaccounts", sa) + "/token", request)
            if answer is None:
                raise PodStartError("ContainerCreating", f"serviceaccount {sa!r} not found")
            self._write_file(vdir / sat["path"], answer["status"]["token"], mode)
        elif "downwardAPI" in src:
            for it in src["downwardAPI"].get("items") or []:
                if "fieldRef" not in it:
                    raise PodStartError("ContainerCreating", f"downwardAPI item {it['path']!r}: only fieldRef")
                value = field_ref(run.body, it["fieldRef"]["fieldPath"], run.ip or "")
                self._write_file(vdir / it["path"], value, it.get("mode", mode))
        else:
            raise PodStartError("ContainerCreating", f"projected volume: unsupported source {sorted(src)}")

    def _hosts_for(self, run: PodRun) -> str:
        assert run.ip is not None
        return hosts_file(self._address(run), self._addresses(), self._services, self.namespace)

    def _address(self, run: PodRun) -> PodAddress:
        spec = run.body["spec"]
        return PodAddress(
            name=run.name,
            ip=run.ip or "",
            hostname=spec.get("hostname") or run.name,
            subdomain=spec.get("subdomain"),
            labels=run.body["metadata"].get("labels") or {},
        )

    def _addresses(self) -> list[PodAddress]:
        return [self._address(r) for r in self.pods.values() if r.running and r.ip]

    def _write_hosts(self) -> None:
        table = (tuple(self._addresses()), tuple(sorted((k, tuple(v.items())) for k, v in self._services.items())))
        if table == self._hosts_table:
            return
        self._hosts_table = table
        for run in self.pods.values():
            if run.running and run.hosts is not None:
                # In place: the pod's /etc/hosts is a bind mount of this very inode.
                with run.hosts.open("r+") as f:
                    f.write(self._hosts_for(run))
                    f.truncate()

    def _reap(self, run: PodRun) -> None:
        if run.proc is None or run.exit_code is not None:
            return
        rc = run.proc.poll()
        if rc is None:
            return
        run.exit_code = exit_code_of(rc)
        run.ready = False
        self._signal(run, signal.SIGKILL)  # whatever the main process left behind
        if run.ns is not None and self.network is not None:
            self.network.remove_pod(run.ns)
            run.ns = None

    def _signal(self, run: PodRun, sig: int) -> None:
        if run.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(run.proc.pid, sig)

    async def _terminate(self, run: PodRun) -> None:
        if run.running:
            if run.kill_at is None:
                # The API server puts the delete request's grace period (else the pod's) here.
                meta, spec = run.body["metadata"], run.body["spec"]
                grace = meta.get("deletionGracePeriodSeconds", spec.get("terminationGracePeriodSeconds", 30))
                run.kill_at = time.monotonic() + float(grace)
                self._signal(run, signal.SIGTERM)
            elif time.monotonic() >= run.kill_at:
                self._signal(run, signal.SIGKILL)
            return
        if run.proc is not None and run.exit_code is None:
            self._reap(run)
        await self._report(run)
        await self._release(run.name, run.body["metadata"].get("uid"))
        self.pods.pop(run.name, None)
        self._teardown(run)

    def _teardown(self, run: PodRun) -> None:
        if run.ns is not None and self.network is not None:
            self.network.remove_pod(run.ns)
            run.ns = None
        shutil.rmtree(run.dir, ignore_errors=True)

    async def _probe_all(self) -> None:
        due = []
        for run in self.pods.values():
            probe = run.container.get("readinessProbe")
            if probe is None or not run.running or time.monotonic() < run.probe_at:
                continue
            period = float(probe.get("periodSeconds", 10))
            if self.probe_period_max is not None:
                period = min(period, self.probe_period_max)
            run.probe_at = time.monotonic() + period
            due.append(self._probe(run, probe))
        await asyncio.gather(*due)

    async def _probe(self, run: PodRun, probe: Mapping[str, Any]) -> None:
        import aiohttp

        get = probe.get("httpGet")
        if get is None:
            raise ValueError(f"pod {run.name}: only httpGet readiness probes are supported")
        url = f"http://{run.ip}:{named_port(run.container, get['port'])}{get.get('path', '/')}"
        ok = False
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
            timeout = aiohttp.ClientTimeout(total=float(probe.get("timeoutSeconds", 1)))
            async with self._http.get(url, timeout=timeout) as r:
                ok = 200 <= r.status < 400
        if ok:
            run.probe_failures = 0
            run.ready = True
        else:
            run.probe_failures += 1
            if run.probe_failures >= int(probe.get("failureThreshold", 3)):
                run.ready = False

    async def _report(self, run: PodRun) -> None:
        c = run.container
        if run.exit_code is not None:
            phase = "Succeeded" if run.exit_code == 0 else "Failed"
            cs = container_status(c["name"], c.get("image", ""), "terminated", ready=False, started=run.started,
                                  exit_code=run.exit_code)  # fmt: skip
        elif run.running:
            phase = "Running"
            cs = container_status(c["name"], c.get("image", ""), "running", ready=run.ready, started=run.started)
        else:
            phase = "Pending"
            reason = run.waiting[0] if run.waiting else "ContainerCreating"
            cs = container_status(c["name"], c.get("image", ""), reason, ready=False, started=None)
            if run.waiting:
                cs["state"]["waiting"]["message"] = run.waiting[1]
        ready = "True" if run.ready and phase == "Running" else "False"
        status: dict[str, Any] = {
            "phase": phase,
            "hostIP": self.network.gateway if self.network else None,
            "hostIPs": [{"ip": self.network.gateway}] if self.network else [],
            "podIP": run.ip,
            "podIPs": [{"ip": run.ip}] if run.ip else [],
            "startTime": run.started,
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Initialized", "status": "True"},
                {"type": "ContainersReady", "status": ready},
                {"type": "Ready", "status": ready},
            ],
            "containerStatuses": [cs],
        }
        # Timestamps change each report: compare without them.
        key = json.loads(json.dumps(status))
        for s in key["containerStatuses"]:
            for st in s["state"].values():
                st.pop("finishedAt", None)
        if key == run.reported:
            return
        patch: dict[str, Any] = {"status": status}
        if self.node is not None:
            # The uid as precondition, as the kubelet patches: never another pod of the same name.
            patch["metadata"] = {"uid": run.uid}
        try:
            if await self._patch(self._path("pods", run.name) + "/status", patch):
                run.reported = key
        except ApiError as e:
            if e.status != 409:
                raise


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "init":
    pod_init(json.loads(Path(sys.argv[2]).read_text()))
