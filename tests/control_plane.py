"""A real Kubernetes control plane for the test suite: etcd, kube-apiserver, and where the
binaries are there kube-controller-manager (garbage collection, namespaces, service accounts,
quota accounting) and kube-scheduler (binds pods to the Node objects a test registers).

envtest's convention: the environment variable KUBEBUILDER_ASSETS names the folder holding the
binaries, each either plain or xz-compressed (`kube-apiserver` or `kube-apiserver.xz`).
`.ci/run` points it at the shared copy; where it is unset the tier skips with that reason, and
where KUBEDISTILL_REQUIRE_K8S=1 (CI) a missing or broken control plane fails instead.

Everything listens on free loopback ports and lives in one temporary folder; `stop()` ends
every process it started. There is no kubelet: pods are admitted, stored and scheduled, never
run (tests/real_node.py starts a real kubelet beside it; tests/node_agent.py plays one quickly).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import secrets
import shutil
import ssl
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ports import free_port

ASSETS_ENV = "KUBEBUILDER_ASSETS"
REQUIRE_ENV = "KUBEDISTILL_REQUIRE_K8S"
CORE = ("etcd", "kube-apiserver")
CONTROLLERS = "kube-controller-manager"
SCHEDULER = "kube-scheduler"
SERVICE_CIDR = "10.0.0.0/24"
SERVICE_IP = "10.0.0.1"
START_TIMEOUT = 120.0


class ControlPlaneError(Exception):
    pass


def assets_dir() -> Path | None:
    value = os.environ.get(ASSETS_ENV)
    return Path(value) if value else None


def required() -> bool:
    return os.environ.get(REQUIRE_ENV) == "1"


def binary(assets: Path, name: str, cache: Path) -> Path | None:
    """The executable `name` from `assets`: as it is, or unpacked once from `name.xz` into `cache`."""
    plain = assets / name
    if plain.is_file() and os.access(plain, os.X_OK):
        return plain
    packed = assets / f"{name}.xz"
    if not packed.is_file():
        return None
    out = cache / name
    stamp = cache / f"{name}.source"
    source = f"{packed.resolve()} {packed.stat().st_size} {packed.stat().st_mtime_ns}"
    if out.is_file() and stamp.is_file() and stamp.read_text() == source:
        return out
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache / f"{name}.tmp"
    with tmp.open("wb") as f:
        subprocess.run(["xz", "-dc", str(packed)], stdout=f, check=True)
    tmp.chmod(0o755)
    tmp.replace(out)
    stamp.write_text(source)
    return out


def stop_process(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM, then SIGKILL after `grace` seconds; returns once it has exited."""
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _openssl(*args: str) -> None:
    r = subprocess.run(["openssl", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise ControlPlaneError(f"openssl {' '.join(args[:2])} failed: {r.stderr.strip()[-500:]}")


CLIENT_EXT = (
    "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n"
)


def _ca(pki: Path, prefix: str = "ca") -> tuple[str, ...]:
    return ("-CA", str(pki / f"{prefix}.crt"), "-CAkey", str(pki / f"{prefix}.key"), "-CAcreateserial",
            "-days", "3650", "-sha256")  # fmt: skip


def sign(pki: Path, name: str, subject: str, ext: str, issuer: str = "ca") -> None:
    """`name`.key and `name`.crt in `pki`, signed by the CA `issuer` with extensions `ext`."""
    _openssl(
        "req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", str(pki / f"{name}.key"),
        "-subj", subject, "-out", str(pki / f"{name}.csr"),
    )  # fmt: skip
    (pki / f"{name}.ext").write_text(ext)
    _openssl("x509", "-req", "-in", str(pki / f"{name}.csr"), *_ca(pki, issuer), "-extfile", str(pki / f"{name}.ext"),
             "-out", str(pki / f"{name}.crt"))  # fmt: skip


def make_pki(pki: Path) -> None:
    """A CA, the API server's serving certificate (127.0.0.1 and the in-cluster names), client
    certificates for the admin and the two controllers, the service-account signing key."""
    pki.mkdir(parents=True, exist_ok=True)
    for prefix, cn in (("ca", "kubedistill-test-ca"), ("front-proxy-ca", "kubedistill-test-front-proxy-ca")):
        _openssl(
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(pki / f"{prefix}.key"),
            "-out", str(pki / f"{prefix}.crt"), "-days", "3650", "-sha256", "-subj", f"/CN={cn}",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
        )  # fmt: skip
    names = "kubernetes,kubernetes.default,kubernetes.default.svc,kubernetes.default.svc.cluster.local,localhost"
    # 10.88.0.1: the API server's address on a real node's bridge (tests/real_node.py).
    san = ",".join([f"IP:127.0.0.1,IP:{SERVICE_IP},IP:10.88.0.1", *(f"DNS:{n}" for n in names.split(","))])
    server = CLIENT_EXT.replace("clientAuth", "serverAuth") + f"subjectAltName={san}\n"
    sign(pki, "apiserver", "/CN=kube-apiserver", server)
    sign(pki, "admin", "/O=system:masters/CN=admin", CLIENT_EXT)
    sign(pki, "controller-manager", "/CN=system:kube-controller-manager", CLIENT_EXT)
    sign(pki, "scheduler", "/CN=system:kube-scheduler", CLIENT_EXT)
    sign(pki, "front-proxy-client", "/CN=front-proxy-client", CLIENT_EXT, issuer="front-proxy-ca")
    _openssl("genrsa", "-out", str(pki / "sa.key"), "2048")
    _openssl("rsa", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub"))


def kubeconfig(server: str, ca_file: Path, user: dict[str, Any], name: str = "test") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "local",
                "cluster": {
                    "server": server,
                    "certificate-authority-data": base64.b64encode(ca_file.read_bytes()).decode(),
                },
            }
        ],
        "users": [{"name": name, "user": user}],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": name}}],
        "current-context": "local",
    }


def cert_user(pki: Path, name: str) -> dict[str, Any]:
    return {
        "client-certificate-data": base64.b64encode((pki / f"{name}.crt").read_bytes()).decode(),
        "client-key-data": base64.b64encode((pki / f"{name}.key").read_bytes()).decode(),
    }


@dataclass
class ControlPlane:
    """A running control plane; `kubeconfig` is the admin's (system:masters)."""

    home: Path
    bins: dict[str, Path]
    port: int = field(default_factory=free_port)
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    admin_token: str = field(default_factory=lambda: secrets.token_hex(24))
    """A static token of the admin (system:masters), for plain HTTP calls."""
    start_seconds: float = 0.0

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def pki(self) -> Path:
        return self.home / "pki"

    @property
    def ca_file(self) -> Path:
        return self.pki / "ca.crt"

    @property
    def kubeconfig(self) -> Path:
        return self.home / "admin.kubeconfig"

    @property
    def has_controllers(self) -> bool:
        return CONTROLLERS in self.processes

    @property
    def has_scheduler(self) -> bool:
        return SCHEDULER in self.processes

    def needs(self, *components: str, why: str) -> None:
        """Skip the calling test unless these components run (fail instead where the tier is
        required, as in CI: there a missing binary must not pass as a skip)."""
        missing = [c for c in components if c not in self.processes]
        if missing:
            import pytest

            message = f"needs {', '.join(missing)} ({why}), not in {ASSETS_ENV}"
            if required():
                pytest.fail(message, pytrace=False)
            pytest.skip(message)

    # -- start and stop ---------------------------------------------------------------------
    def start(self) -> None:
        started = time.monotonic()
        make_pki(self.pki)
        (self.pki / "tokens.csv").write_text(f"{self.admin_token},admin-token,admin-token-uid,system:masters\n")
        self._write_kubeconfig(self.kubeconfig, cert_user(self.pki, "admin"), "admin")
        for who in ("controller-manager", "scheduler"):
            self._write_kubeconfig(self.home / f"{who}.kubeconfig", cert_user(self.pki, who), who)
        etcd_client, etcd_peer = free_port(), free_port()
        self._spawn(
            "etcd",
            "--name", "local", "--data-dir", str(self.home / "etcd-data"),
            "--listen-client-urls", f"http://127.0.0.1:{etcd_client}",
            "--advertise-client-urls", f"http://127.0.0.1:{etcd_client}",
            "--listen-peer-urls", f"http://127.0.0.1:{etcd_peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{etcd_peer}",
            "--initial-cluster", f"local=http://127.0.0.1:{etcd_peer}", "--initial-cluster-state", "new",
            "--unsafe-no-fsync", "--logger", "zap", "--log-outputs", "stderr",
        )  # fmt: skip
        self._wait("etcd", lambda: b'"health":"true"' in _get(f"http://127.0.0.1:{etcd_client}/health"))
        pki = self.pki
        self._spawn(
            "kube-apiserver",
            # Every address: pods on a real node (tests/real_node.py) reach it through the bridge.
            "--bind-address=0.0.0.0", "--advertise-address=127.0.0.1", f"--secure-port={self.port}",
            f"--etcd-servers=http://127.0.0.1:{etcd_client}",
            f"--tls-cert-file={pki / 'apiserver.crt'}", f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}", f"--token-auth-file={pki / 'tokens.csv'}",
            f"--requestheader-client-ca-file={pki / 'front-proxy-ca.crt'}",
            "--requestheader-allowed-names=front-proxy-client", "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group", "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={pki / 'front-proxy-client.crt'}",
            f"--proxy-client-key-file={pki / 'front-proxy-client.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki / 'sa.pub'}", f"--service-account-signing-key-file={pki / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--authorization-mode=Node,RBAC",
            "--allow-privileged=true", "--endpoint-reconciler-type=none", "--profiling=false", "-v=1",
            # `kubectl logs` dials a node's kubelet by its address, not by a name no DNS here knows.
            "--kubelet-preferred-address-types=InternalIP,Hostname",
            # Off by default upstream, on in OpenShift and hardened clusters: an owner reference
            # with blockOwnerDeletion needs update on the owner's finalizers (the chart grants it).
            "--enable-admission-plugins=OwnerReferencesPermissionEnforcement",
        )  # fmt: skip
        self._wait("kube-apiserver", lambda: self.get("/readyz") == b"ok")
        if CONTROLLERS in self.bins:
            kcm = self.home / "controller-manager.kubeconfig"
            self._spawn(
                CONTROLLERS,
                f"--kubeconfig={kcm}", f"--authentication-kubeconfig={kcm}", f"--authorization-kubeconfig={kcm}",
                "--bind-address=127.0.0.1", f"--secure-port={free_port()}",
                f"--service-account-private-key-file={pki / 'sa.key'}", f"--root-ca-file={pki / 'ca.crt'}",
                f"--cluster-signing-cert-file={pki / 'ca.crt'}", f"--cluster-signing-key-file={pki / 'ca.key'}",
                "--use-service-account-credentials=true", "--leader-elect=false",
                # Microshift's fork adds an OpenShift controller that needs OpenShift's APIs.
                "--controllers=*,-service-ca-certificate-publisher-controller",
                f"--service-cluster-ip-range={SERVICE_CIDR}", "--cluster-name=kubernetes",
                "--profiling=false", "-v=1",
            )  # fmt: skip
            # The controllers act: the service-account controller makes `default` in `default`.
            self._wait(CONTROLLERS, lambda: self._exists("/api/v1/namespaces/default/serviceaccounts/default"))
        if SCHEDULER in self.bins:
            sched = self.home / "scheduler.kubeconfig"
            self._spawn(
                SCHEDULER,
                f"--kubeconfig={sched}", f"--authentication-kubeconfig={sched}",
                f"--authorization-kubeconfig={sched}", "--bind-address=127.0.0.1", f"--secure-port={free_port()}",
                "--leader-elect=false", "--profiling=false", "-v=1",
            )  # fmt: skip
        self.start_seconds = time.monotonic() - started

    def stop(self) -> None:
        for name in (SCHEDULER, CONTROLLERS, "kube-apiserver", "etcd"):
            proc = self.processes.pop(name, None)
            if proc is not None:
                stop_process(proc, grace=20)

    def _spawn(self, name: str, *args: str) -> None:
        logs = self.home / "logs"
        logs.mkdir(exist_ok=True)
        with (logs / f"{name}.log").open("wb") as log:
            self.processes[name] = subprocess.Popen(
                [str(self.bins[name]), *args], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )

    def _wait(self, name: str, ready: Any) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            with contextlib.suppress(OSError, ValueError):
                if ready():
                    return
            proc = self.processes[name]
            if proc.poll() is not None or time.monotonic() > deadline:
                why = f"exited with {proc.returncode}" if proc.poll() is not None else f"not ready in {START_TIMEOUT} s"
                raise ControlPlaneError(f"{name} {why}; its log ends:\n{self.log_tail(name)}")
            time.sleep(0.2)

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.home / "logs" / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def client_cert(self, name: str, subject: str) -> None:
        """A client certificate `name`.crt/.key in the PKI, signed by the cluster's CA (a kubelet's:
        /O=system:nodes/CN=system:node:NAME)."""
        sign(self.pki, name, subject, CLIENT_EXT)

    def _write_kubeconfig(self, path: Path, user: dict[str, Any], name: str) -> None:
        path.write_text(yaml.safe_dump(kubeconfig(self.server, self.ca_file, user, name)))
        path.chmod(0o600)

    # -- talking to it ----------------------------------------------------------------------
    def get(self, path: str) -> bytes:
        """GET as the admin (its static token): the body."""
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        req = urllib.request.Request(self.server + path, headers={"Authorization": f"Bearer {self.admin_token}"})
        with urllib.request.urlopen(req, context=ctx, timeout=5) as resp:
            return bytes(resp.read())

    def _exists(self, path: str) -> bool:
        try:
            self.get(path)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return False
            raise
        return True

    def wait_established(self, crd: str, timeout: float = 60.0) -> None:
        """`kubectl wait --for=condition=Established crd/NAME`, asked again while the CRD has no
        conditions yet: kubectl 1.35 fails at once on a CRD created an instant before
        (".status.conditions accessor error: <nil>") instead of waiting for it."""
        deadline = time.monotonic() + timeout
        while True:
            left = max(1, int(deadline - time.monotonic()))
            r = self.kubectl("wait", "--for=condition=Established", f"crd/{crd}", f"--timeout={left}s", check=False)
            if r.returncode == 0:
                return
            if "accessor error" not in r.stderr or time.monotonic() > deadline:
                raise AssertionError(f"crd/{crd} is not Established: {r.stdout}{r.stderr}")
            time.sleep(0.2)

    def kubectl(
        self, *args: str, stdin: str | None = None, kubeconfig: Path | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """The real kubectl (scripts/install-helm.sh) as the admin, or as `kubeconfig`'s user."""
        from k8s_offline import tool

        env = {"PATH": "/usr/bin:/bin", "HOME": str(self.home), "KUBECONFIG": str(kubeconfig or self.kubeconfig)}
        r = subprocess.run([tool("kubectl"), *args], input=stdin, capture_output=True, text=True, timeout=120, env=env)
        if check and r.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
        return r

    def apply(self, docs: list[dict[str, Any]] | dict[str, Any], *extra: str) -> str:
        """`kubectl apply` of objects (server-side validation, fieldValidation=Strict)."""
        items = docs if isinstance(docs, list) else [docs]
        return self.kubectl("apply", "-f", "-", *extra, stdin="\n---\n".join(json.dumps(d) for d in items)).stdout

    def namespace(self, name: str, labels: dict[str, str] | None = None) -> str:
        """Create a namespace (labels e.g. Pod Security's enforce level) and, where the service
        account controller runs, wait for its `default` ServiceAccount (pods need it)."""
        self.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels or {}}})
        if self.has_controllers:
            deadline = time.monotonic() + 30
            while not self._exists(f"/api/v1/namespaces/{name}/serviceaccounts/default"):
                if time.monotonic() > deadline:
                    raise ControlPlaneError(f"no default ServiceAccount in namespace {name} after 30 s")
                time.sleep(0.1)
        return name

    def token(self, namespace: str, service_account: str, seconds: int = 3600, bound_secret: str | None = None) -> str:
        """A ServiceAccount token from the TokenRequest API, as the kubelet projects one into a
        pod (bound to a Secret, it dies with it: a way to revoke it)."""
        args = ["create", "token", service_account, "-n", namespace, f"--duration={seconds}s"]
        if bound_secret:
            args += ["--bound-object-kind=Secret", f"--bound-object-name={bound_secret}"]
        return self.kubectl(*args).stdout.strip()

    def token_kubeconfig(self, path: Path, token: str | None = None, token_file: Path | None = None) -> Path:
        """A kubeconfig holding only a bearer token (or a tokenFile) and the CA: no certificate."""
        user: dict[str, Any] = {"token": token} if token is not None else {"tokenFile": str(token_file)}
        path.write_text(yaml.safe_dump(kubeconfig(self.server, self.ca_file, user, "token-user")))
        path.chmod(0o600)
        return path


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=3) as resp:
        return bytes(resp.read())


def start(cache: Path) -> ControlPlane:
    """Start a control plane from KUBEBUILDER_ASSETS, binaries unpacked into `cache` (reused
    between runs). Raises ControlPlaneError with the reason when it cannot."""
    assets = assets_dir()
    if assets is None:
        raise ControlPlaneError(f"{ASSETS_ENV} is not set (a folder with kube-apiserver and etcd, plain or .xz)")
    if shutil.which("openssl") is None:
        raise ControlPlaneError("openssl is not installed (the control plane's certificates need it)")
    bins: dict[str, Path] = {}
    for name in (*CORE, CONTROLLERS, SCHEDULER):
        found = binary(assets, name, cache)
        if found is not None:
            bins[name] = found
        elif name in CORE:
            raise ControlPlaneError(f"{ASSETS_ENV}={assets} has no {name} (nor {name}.xz)")
    plane = ControlPlane(home=Path(tempfile.mkdtemp(prefix="kubedistill-k8s-")), bins=bins)
    try:
        plane.start()
    except BaseException:
        plane.stop()
        raise
    return plane
