"""A real Kubernetes node for the test suite: the kubelet of ../shared/k8s (v1.36.2) beside Debian's
containerd and runc, with Debian's CNI plugins for the pod network and dnsmasq for cluster DNS,
joined to the session's control plane (tests/control_plane.py).

What a cluster gives a pod and this machine lacks, and what stands in for it:

* **Pod network**: a bridge (`kd0`, 10.88.0.1/24) made before containerd starts, used by the CNI
  `bridge` + `host-local` plugins. The host, where the tests and the API server run, is the
  bridge's gateway, so pods reach it and it reaches them.
* **The `kubernetes` Service** (10.0.0.1:443): no kube-proxy, so one iptables DNAT rule sends it to
  the API server, which listens on every address.
* **Cluster DNS**: CoreDNS is not packaged here. dnsmasq (Debian) answers on the bridge's address
  from a hosts file the harness rewrites from the cluster's EndpointSlices (headless Services: the
  Service's name -> its ready endpoints, `<hostname>.<service>` -> that pod), and NXDOMAIN for any
  other name under cluster.local.
* **Images**: no registry is reachable. The images scripts/build-images.sh built (OCI archives)
  are imported into containerd's `k8s.io` namespace, the pause image among them, set as
  containerd's `sandbox_image`.
* **oom_score_adj**: this machine refuses negative values even to root, and the kubelet asks for
  -998 (sandboxes) and -997 (Guaranteed pods). containerd's runc is a wrapper that clamps
  `process.oomScoreAdj` at 0 in the bundle before it runs runc (../shared/notes/real-node-facts.md).
* **cgroups v1** here: `failCgroupV1: false`, the cgroupfs driver.

Needs root. `stop()` ends every process and removes the bridge, the rule and the addresses it
made; containerd's image store stays under CACHE_ROOT, so a later run imports only images that
changed.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from control_plane import SERVICE_IP, ControlPlane, binary, kubeconfig, stop_process

BRIDGE = "kd0"
BRIDGE_CIDR = "10.88.0.0/24"
GATEWAY = "10.88.0.1"
"""The bridge's address on the host: the node's IP, the DNS server, the API server's address for pods."""
CLUSTER_DOMAIN = "cluster.local"
NODE_NAME = "kd-real-node"
TAINT_KEY = "kubedistill.io/real-node"
TAINT = f"{TAINT_KEY}=true:NoSchedule"
TOLERATION = {"key": TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}
"""Only pods that tolerate it run on the real node: other tests' pods stay Pending as they expect."""
CACHE_ROOT = Path("/var/lib/kubedistill-test-node")
"""containerd's image store, kept between runs (the images are large; importing them is slow)."""
START_TIMEOUT = 120.0

RUNC_WRAPPER = """\
import json, os, sys
# containerd's runc for this machine, which refuses negative oom_score_adj even to root: clamp
# process.oomScoreAdj at 0 in the bundle's config.json, then exec the real runc.
args = sys.argv[1:]
bundle = None
for i, a in enumerate(args):
    if a in ("--bundle", "-b") and i + 1 < len(args):
        bundle = args[i + 1]
    elif a.startswith("--bundle="):
        bundle = a.split("=", 1)[1]
if bundle is None and any(a in ("create", "run") for a in args):
    bundle = os.getcwd()
if bundle is not None:
    path = os.path.join(bundle, "config.json")
    if os.path.isfile(path):
        with open(path) as f:
            spec = json.load(f)
        proc = spec.get("process") or {}
        if proc.get("oomScoreAdj", 0) < 0:
            proc["oomScoreAdj"] = 0
            with open(path + ".tmp", "w") as f:
                json.dump(spec, f)
            os.replace(path + ".tmp", path)
os.execv(RUNC, ["runc", *args])
"""


class RealNodeError(Exception):
    pass


def missing_tools() -> list[str]:
    """The host programs a real node needs (Debian packages: containerd, runc,
    containernetworking-plugins, dnsmasq-base, iptables, iproute2)."""
    tools = ["containerd", "runc", "ctr", "dnsmasq", "iptables", "ip"]
    out = [t for t in tools if shutil.which(t, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None]
    if not Path("/usr/lib/cni/bridge").exists():
        out.append("/usr/lib/cni/bridge")
    return out


def _sbin(name: str) -> str:
    found = shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
    if found is None:
        raise RealNodeError(f"{name} is not installed")
    return found


def _run(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RealNodeError(f"{' '.join(args)} failed ({r.returncode}): {(r.stderr or r.stdout).strip()[-800:]}")
    return r


def dns_hosts(slices: list[dict[str, Any]], domain: str = CLUSTER_DOMAIN) -> list[tuple[str, str]]:
    """(address, name) pairs for cluster DNS from EndpointSlices, as CoreDNS's kubernetes plugin
    answers for headless Services: `<svc>.<ns>.svc.<domain>` -> every ready endpoint and
    `<hostname>.<svc>.<ns>.svc.<domain>` -> the endpoint with that hostname. An endpoint whose
    `ready` condition is absent counts as ready (the API's own reading)."""
    out: list[tuple[str, str]] = []
    for s in slices:
        meta = s.get("metadata") or {}
        service = (meta.get("labels") or {}).get("kubernetes.io/service-name")
        if not service or s.get("addressType") != "IPv4":
            continue
        base = f"{service}.{meta['namespace']}.svc.{domain}"
        for ep in s.get("endpoints") or []:
            if (ep.get("conditions") or {}).get("ready") is False:
                continue
            for address in ep.get("addresses") or []:
                out.append((address, base))
                if ep.get("hostname"):
                    out.append((address, f"{ep['hostname']}.{base}"))
    return sorted(set(out))


@dataclass
class RealNode:
    """A kubelet + containerd node registered with `plane` as NODE_NAME (tainted TAINT)."""

    plane: ControlPlane
    kubelet_bin: Path
    images: list[Path]
    """OCI archives to import into containerd's k8s.io namespace (the pause image among them)."""
    pause_image: str
    home: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kd-node-", dir="/run")))
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _rules: list[list[str]] = field(default_factory=list)
    _dns_stop: threading.Event = field(default_factory=threading.Event)
    _dns_thread: threading.Thread | None = None
    start_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def socket(self) -> Path:
        return self.home / "containerd.sock"

    @property
    def logs(self) -> Path:
        return self.home / "logs"

    # -- start -------------------------------------------------------------------------------
    def start(self) -> None:
        started = time.monotonic()
        self.logs.mkdir(parents=True, exist_ok=True)
        clear_leftovers(keep=self.home)
        self._network()
        self._containerd()
        t = time.monotonic()
        try:
            self.import_images(self.images)
        except RealNodeError:
            # A run killed while containerd unpacked can leave the kept store inconsistent
            # ("parent snapshot ... does not exist"): start it over, empty.
            stop_process(self.processes.pop("containerd"), grace=10)
            shutil.rmtree(CACHE_ROOT, ignore_errors=True)
            self._containerd()
            self.import_images(self.images)
        self.start_seconds["images"] = time.monotonic() - t
        self._dns()
        self._kubelet()
        self.start_seconds["total"] = time.monotonic() - started

    def _network(self) -> None:
        ip = _sbin("ip")
        _run(ip, "link", "del", BRIDGE, check=False)
        _run(ip, "link", "add", BRIDGE, "type", "bridge")
        _run(ip, "addr", "add", f"{GATEWAY}/24", "dev", BRIDGE)
        _run(ip, "link", "set", BRIDGE, "up")
        host, port = SERVICE_IP, self.plane.port
        rule = ["-t", "nat", "PREROUTING", "-d", host, "-p", "tcp", "--dport", "443", "-j", "DNAT",
                "--to-destination", f"{GATEWAY}:{port}"]  # fmt: skip
        _run(_sbin("iptables"), rule[0], rule[1], "-A", *rule[2:])
        self._rules.append(rule)
        cni = self.home / "cni"
        cni.mkdir()
        (cni / "10-kubedistill.conflist").write_text(
            json.dumps(
                {
                    "cniVersion": "1.0.0",
                    "name": "kubedistill",
                    "plugins": [
                        {
                            "type": "bridge",
                            "bridge": BRIDGE,
                            "isGateway": True,
                            "ipMasq": False,
                            "hairpinMode": True,
                            "ipam": {
                                "type": "host-local",
                                "ranges": [[{"subnet": BRIDGE_CIDR, "gateway": GATEWAY}]],
                                # Everything else (the `kubernetes` Service's address) via the host.
                                "routes": [{"dst": "0.0.0.0/0"}],
                                "dataDir": str(self.home / "cni-ipam"),
                            },
                        },
                        {"type": "portmap", "capabilities": {"portMappings": True}},
                    ],
                }
            )
        )

    def _containerd(self) -> None:
        wrapper = self.home / "runc-no-negative-oom"
        wrapper.write_text(f"#!{sys.executable} -S\nRUNC = {_sbin('runc')!r}\n{RUNC_WRAPPER}")
        wrapper.chmod(0o755)
        root = CACHE_ROOT / "containerd"
        root.mkdir(parents=True, exist_ok=True)
        config = {
            "version": 2,
            "root": str(root),
            "state": str(self.home / "containerd-state"),
            "grpc": {"address": str(self.socket)},
            "ttrpc": {"address": str(self.home / "containerd-ttrpc.sock")},
            "plugins": {
                "io.containerd.grpc.v1.cri": {
                    "sandbox_image": self.pause_image,
                    "containerd": {
                        "snapshotter": "overlayfs",
                        "default_runtime_name": "runc",
                        "runtimes": {
                            "runc": {
                                "runtime_type": "io.containerd.runc.v2",
                                "options": {"BinaryName": str(wrapper), "SystemdCgroup": False},
                            }
                        },
                    },
                    "cni": {"bin_dir": "/usr/lib/cni", "conf_dir": str(self.home / "cni")},
                }
            },
        }
        (self.home / "containerd.toml").write_text(_toml(config))
        self._spawn("containerd", _sbin("containerd"), "--config", str(self.home / "containerd.toml"))
        self._wait("containerd", lambda: self.ctr("version", check=False).returncode == 0)
        # Leftovers of an earlier run's pods (their sandboxes) would be the kubelet's to clean.
        for c in self.ctr("containers", "ls", "-q", check=False).stdout.split():
            self.ctr("tasks", "kill", "-s", "SIGKILL", c, check=False)
            self.ctr("containers", "rm", c, check=False)

    def ctr(self, *args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return _run(_sbin("ctr"), "--address", str(self.socket), "-n", "k8s.io", *args, check=check, timeout=timeout)

    def import_images(self, archives: list[Path]) -> None:
        """Import each OCI archive unless the same archive (by size and mtime) was imported into
        the kept store before."""
        stamps = CACHE_ROOT / "imported"
        stamps.mkdir(parents=True, exist_ok=True)
        have = set(self.ctr("images", "ls", "-q").stdout.split())
        for archive in archives:
            st = archive.stat()
            key = hashlib.sha256(f"{archive.resolve()} {st.st_size} {st.st_mtime_ns}".encode()).hexdigest()[:16]
            stamp = stamps / archive.name
            names = stamp.read_text().split()[1:] if stamp.exists() else []
            if stamp.exists() and stamp.read_text().split()[0] == key and names and set(names) <= have:
                continue
            out = self.ctr("images", "import", "--all-platforms", str(archive)).stdout
            imported = [line.split()[1] for line in out.splitlines() if line.startswith("unpacking ")]
            stamp.write_text(" ".join([key, *imported]))

    def _dns(self) -> None:
        hosts = self.home / "cluster-hosts"
        hosts.write_text("")
        self._spawn(
            "dnsmasq",
            _sbin("dnsmasq"), "--keep-in-foreground", "--no-daemon", "--log-facility=-",
            f"--listen-address={GATEWAY}", "--bind-interfaces", "--except-interface=lo", "--port=53",
            "--no-resolv", "--no-hosts", f"--addn-hosts={hosts}", f"--local=/{CLUSTER_DOMAIN}/",
            "--local-ttl=0", "--neg-ttl=0", "--user=root", f"--pid-file={self.home / 'dnsmasq.pid'}",
        )  # fmt: skip
        self._dns_thread = threading.Thread(target=self._feed_dns, args=(hosts,), daemon=True, name="real-node-dns")
        self._dns_thread.start()

    def _feed_dns(self, hosts: Path) -> None:
        written = ""
        while not self._dns_stop.is_set():
            with contextlib.suppress(Exception):
                body = json.loads(self.plane.get("/apis/discovery.k8s.io/v1/endpointslices"))
                text = "".join(f"{a} {n}\n" for a, n in dns_hosts(body.get("items") or []))
                if text != written:
                    tmp = hosts.with_suffix(".tmp")
                    tmp.write_text(text)
                    tmp.replace(hosts)
                    written = text
                    proc = self.processes.get("dnsmasq")
                    if proc is not None and proc.poll() is None:
                        proc.send_signal(signal.SIGHUP)  # dnsmasq re-reads --addn-hosts
            self._dns_stop.wait(0.3)

    def _kubelet(self) -> None:
        pki = self.plane.pki
        self.plane.client_cert(f"node-{NODE_NAME}", f"/O=system:nodes/CN=system:node:{NODE_NAME}")
        kc = self.home / "kubelet.kubeconfig"
        user = {
            "client-certificate-data": base64.b64encode((pki / f"node-{NODE_NAME}.crt").read_bytes()).decode(),
            "client-key-data": base64.b64encode((pki / f"node-{NODE_NAME}.key").read_bytes()).decode(),
        }
        server = f"https://{GATEWAY}:{self.plane.port}"
        kc.write_text(yaml.safe_dump(kubeconfig(server, self.plane.ca_file, user, NODE_NAME)))
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "failCgroupV1": False,
            "cgroupDriver": "cgroupfs",
            "failSwapOn": False,
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            "clusterDNS": [GATEWAY],
            "clusterDomain": CLUSTER_DOMAIN,
            "resolvConf": str(self._resolv_conf()),
            "authentication": {
                "anonymous": {"enabled": True},
                "webhook": {"enabled": False},
                "x509": {"clientCAFile": str(self.plane.ca_file)},
            },
            "authorization": {"mode": "AlwaysAllow"},
            "address": GATEWAY,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": 0,
            "registerWithTaints": [{"key": TAINT_KEY, "value": "true", "effect": "NoSchedule"}],
            # The machine's disk is shared with the suite: evict on nothing but a nearly full one.
            "evictionHard": {"nodefs.available": "1%", "imagefs.available": "1%", "memory.available": "100Mi"},
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "serializeImagePulls": False,
            "syncFrequency": "5s",
            "fileCheckFrequency": "5s",
            "nodeStatusReportFrequency": "10s",
            "localStorageCapacityIsolation": True,
            "protectKernelDefaults": False,
            "makeIPTablesUtilChains": False,
            "maxPods": 30,
        }
        (self.home / "kubelet.yaml").write_text(yaml.safe_dump(config))
        self._spawn(
            "kubelet",
            str(self.kubelet_bin), f"--config={self.home / 'kubelet.yaml'}", f"--kubeconfig={kc}",
            f"--root-dir={self.home / 'kubelet'}", f"--cert-dir={self.home / 'kubelet-pki'}",
            f"--hostname-override={NODE_NAME}", f"--node-ip={GATEWAY}", "-v=1",
        )  # fmt: skip
        self._wait("kubelet", self._ready)

    def _resolv_conf(self) -> Path:
        # Pods with dnsPolicy ClusterFirst get clusterDNS; this is for Default-policy pods only.
        path = self.home / "resolv.conf"
        path.write_text(f"nameserver {GATEWAY}\n")
        return path

    def _ready(self) -> bool:
        node = json.loads(self.plane.get(f"/api/v1/nodes/{NODE_NAME}"))
        return any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"].get("conditions") or [])

    # -- stop --------------------------------------------------------------------------------
    def stop(self) -> None:
        self._dns_stop.set()
        if self._dns_thread is not None:
            self._dns_thread.join(timeout=5)
        proc = self.processes.pop("kubelet", None)
        if proc is not None:
            stop_process(proc, grace=10)
        if "containerd" in self.processes:
            # Every pod's containers, then their sandboxes (the shims outlive containerd otherwise).
            for c in self.ctr("containers", "ls", "-q", check=False).stdout.split():
                self.ctr("tasks", "kill", "-s", "SIGKILL", c, check=False)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.ctr("tasks", "delete", "-f", c, check=False, timeout=20)
                self.ctr("containers", "rm", c, check=False)
        for name in ("dnsmasq", "containerd"):
            proc = self.processes.pop(name, None)
            if proc is not None:
                stop_process(proc, grace=10)
        subprocess.run(["pkill", "-f", f"containerd-shim-runc-v2 .*-address {self.socket}"], check=False)
        for rule in self._rules:
            _run(_sbin("iptables"), rule[0], rule[1], "-D", *rule[2:], check=False)
        self._rules.clear()
        _run(_sbin("ip"), "link", "del", BRIDGE, check=False)
        # The kubelet's pod volumes may still be mounted (tmpfs for Secrets, projected tokens).
        kubelet_dir = self.home / "kubelet"
        if kubelet_dir.exists():
            mounts = [
                line.split()[1]
                for line in Path("/proc/mounts").read_text().splitlines()
                if line.split()[1].startswith(str(self.home))
            ]
            for m in sorted(mounts, key=len, reverse=True):
                subprocess.run(["umount", "-l", m], check=False, capture_output=True)
        shutil.rmtree(self.home, ignore_errors=True)

    # -- helpers -----------------------------------------------------------------------------
    def _spawn(self, name: str, *args: str) -> None:
        with (self.logs / f"{name}.log").open("wb") as log:
            self.processes[name] = subprocess.Popen(
                list(args), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )

    def _wait(self, name: str, ready: Any) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        t = time.monotonic()
        while True:
            with contextlib.suppress(Exception):
                if ready():
                    self.start_seconds[name] = time.monotonic() - t
                    return
            proc = self.processes[name]
            if proc.poll() is not None or time.monotonic() > deadline:
                why = f"exited with {proc.returncode}" if proc.poll() is not None else f"not ready in {START_TIMEOUT} s"
                raise RealNodeError(f"{name} {why}; its log ends:\n{self.log_tail(name)}")
            time.sleep(0.2)

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.logs / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def clear_leftovers(keep: Path) -> None:
    """What a run killed before its teardown left: its node's processes (they hold the kubelet's
    port and the bridge), containers, mounts, DNAT rule and bridge."""
    for pattern in (
        "kubelet --config=/run/kd-node-",
        "containerd --config /run/kd-node-",
        "dnsmasq .*--listen-address=" + GATEWAY,
    ):
        subprocess.run(["pkill", "-KILL", "-f", pattern], check=False)
    subprocess.run(["pkill", "-KILL", "-f", "containerd-shim-runc-v2 .*-address /run/kd-node-"], check=False)
    rules = _run(_sbin("iptables"), "-t", "nat", "-S", "PREROUTING", check=False).stdout.splitlines()
    for rule in rules:
        if f"-d {SERVICE_IP}/32" in rule and "DNAT" in rule and rule.startswith("-A "):
            _run(_sbin("iptables"), "-t", "nat", "-D", *rule.split()[1:], check=False)
    for old in (p for p in Path("/run").glob("kd-node-*") if p != keep):
        mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
        for m in sorted((m for m in mounts if m.startswith(str(old))), key=len, reverse=True):
            subprocess.run(["umount", "-l", m], check=False, capture_output=True)
        shutil.rmtree(old, ignore_errors=True)
    _run(_sbin("ip"), "link", "del", BRIDGE, check=False)


def _toml(config: dict[str, Any], prefix: str = "") -> str:
    """The containerd config as TOML (tables after plain keys, as TOML requires)."""
    plain = {k: v for k, v in config.items() if not isinstance(v, dict)}
    tables = {k: v for k, v in config.items() if isinstance(v, dict)}
    lines = [f"[{prefix}]"] if prefix and plain else []
    lines += [f"{k} = {json.dumps(v)}" for k, v in plain.items()]
    out = "\n".join(lines) + ("\n" if lines else "")
    for k, v in tables.items():
        key = f'"{k}"' if "." in k else k
        out += _toml(v, f"{prefix}.{key}" if prefix else key)
    return out


def preflight() -> str | None:
    """Why a real node cannot start on this machine, or None."""
    if os.geteuid() != 0:
        return "a real node needs root (network, mounts, containerd)"
    missing = missing_tools()
    if missing:
        return f"not installed: {', '.join(missing)} (scripts/install-node.sh installs them)"
    return None


def start(plane: ControlPlane, images: list[Path], pause_image: str, cache: Path) -> RealNode:
    """Start a real node joined to `plane`. Raises RealNodeError with the reason when it cannot."""
    why = preflight()
    if why is not None:
        raise RealNodeError(why)
    from control_plane import assets_dir

    assets = assets_dir()
    kubelet = binary(assets, "kubelet", cache) if assets is not None else None
    if kubelet is None:
        raise RealNodeError(f"no kubelet (nor kubelet.xz) in {assets}")
    node = RealNode(plane=plane, kubelet_bin=kubelet, images=images, pause_image=pause_image)
    try:
        node.start()
    except BaseException:
        node.stop()
        raise
    return node
