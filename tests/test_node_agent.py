"""The node-agent twin (tests/node_agent.py): its pure pieces, then real pods run through the
KMock API (network and DNS, volumes, env, user and read-only root, status, deletion and
cleanup), then as a kubelet on the real control plane: the Node it registers, the scheduler's
binding, the ServiceAccount's projected volume, graceful deletion."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from control_plane import CONTROLLERS, SCHEDULER
from node_agent import (
    FINALIZER,
    LEASE_NAMESPACE,
    TWIN_TOLERATION,
    ApiAccess,
    Image,
    NodeAgent,
    NodeRegistration,
    PodAddress,
    PodStartError,
    container_status,
    covered_by_volumes,
    exit_code_of,
    expand,
    hosts_file,
    in_root,
    resolve_env,
    security,
)
from operator_fixtures import NS, Cluster, FastEmulator, eventually, prepare_emulator

# -- pure pieces -------------------------------------------------------------------------------


def test_expand_follows_kubernetes_rules() -> None:
    env = {"A": "1", "B": "x"}
    assert expand("$(A)-$(B)-$(C)-$$(A)", env) == "1-x-$(C)-$(A)"


POD = {
    "metadata": {"name": "p-0", "namespace": "ml", "uid": "u1", "labels": {"app": "p"}},
    "spec": {"hostname": "p-0", "subdomain": "p"},
}


def test_resolve_env_sources_in_order() -> None:
    container = {
        "env": [
            {"name": "A", "value": "a"},
            {"name": "B", "value": "$(A)/b"},
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "NSP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
            {"name": "CM", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "k"}}},
            {"name": "SEC", "valueFrom": {"secretKeyRef": {"name": "s", "key": "t"}}},
            {"name": "OPT", "valueFrom": {"configMapKeyRef": {"name": "none", "key": "k", "optional": True}}},
        ]
    }
    maps = {"cm": {"k": "v"}}
    secrets = {"s": {"t": "tok"}}
    env = resolve_env(POD, container, "10.1.2.3", maps.get, secrets.get, Image(bin_dir=Path("/venv/bin")))
    assert env["PATH"].startswith("/venv/bin:")
    assert (env["A"], env["B"], env["IP"], env["NAME"], env["NSP"], env["APP"]) == (
        "a",
        "a/b",
        "10.1.2.3",
        "p-0",
        "ml",
        "p",
    )
    assert (env["CM"], env["SEC"], env["HOSTNAME"]) == ("v", "tok", "p-0")
    assert "OPT" not in env and env["HF_HOME"] == "/tmp/hf"  # the image's own ENV


@pytest.mark.parametrize(
    "ref,message",
    [
        ({"configMapKeyRef": {"name": "cm", "key": "missing"}}, "key 'missing' of ConfigMap 'cm' not found"),
        ({"secretKeyRef": {"name": "nope", "key": "t"}}, "Secret 'nope' not found"),
        ({"fieldRef": {"fieldPath": "spec.bogus"}}, "unsupported fieldRef 'spec.bogus'"),
    ],
)
def test_resolve_env_refuses_what_a_kubelet_refuses(ref: dict[str, Any], message: str) -> None:
    container = {"env": [{"name": "X", "valueFrom": ref}]}
    with pytest.raises(PodStartError, match=message) as e:
        resolve_env(POD, container, "10.0.0.1", {"cm": {"k": "v"}}.get, {}.get)
    assert e.value.reason == "CreateContainerConfigError"


def test_the_installation_stays_visible_under_a_pod_volume() -> None:
    # A checkout in /tmp (a CI clone) is hidden by the restricted defaults' /tmp emptyDir unless
    # the twin binds it back, as an image's own files would be.
    files = ["/tmp/ci/checkout", "/root/.pyenv/versions/3.11.7"]
    assert covered_by_volumes(files, ["/tmp", "/etc/hosts", "/ckpt"]) == ["/tmp/ci/checkout"]
    assert covered_by_volumes(files, ["/tmp/ci/checkout/"]) == ["/tmp/ci/checkout"]
    assert covered_by_volumes(files, ["/tm", "/ckpt"]) == []
    assert covered_by_volumes(files, ["/"]) == files
    assert all(os.path.isabs(f) for f in Image().files)


def test_mount_targets_resolve_inside_the_pod_s_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "run").mkdir(parents=True)
    (root / "var").mkdir()
    (root / "var" / "run").symlink_to("/run")  # as on the host: absolute
    (root / "opt" / "real").mkdir(parents=True)
    (root / "opt" / "link").symlink_to("real")
    (root / "loop").symlink_to("loop")
    sa = "/var/run/secrets/kubernetes.io/serviceaccount"
    assert in_root(str(root), sa) == f"{root}/run/secrets/kubernetes.io/serviceaccount"
    assert in_root(str(root), "/opt/link/x") == f"{root}/opt/real/x"
    assert in_root(str(root), "/../../etc/hosts") == f"{root}/etc/hosts"  # `..` stops at the root
    assert in_root(str(root), "/tmp/") == f"{root}/tmp"
    with pytest.raises(OSError, match="symbolic links"):
        in_root(str(root), "/loop/x")


def test_hosts_file_answers_like_cluster_dns() -> None:
    trainer = PodAddress("j-trainer-0", "10.9.0.2", "j-trainer-0", "j-trainer", {"role": "trainer"})
    rollout = PodAddress("j-rollout-0", "10.9.0.3", "j-rollout-0", "j-rollout", {"role": "rollout"})
    orphan = PodAddress("x", "10.9.0.4", "x", "no-such-service", {})
    services = {"j-trainer": {"role": "trainer"}, "j-rollout": {"role": "rollout"}}
    text = hosts_file(trainer, [trainer, rollout, orphan], services, "ml")

    def lookup(name: str) -> list[str]:
        return [line.split()[0] for line in text.splitlines() if name in line.split()[1:]]

    assert lookup("j-trainer-0") == ["10.9.0.2"]  # own short hostname
    assert lookup("j-rollout-0.j-rollout.ml.svc") == ["10.9.0.3"]
    assert lookup("j-rollout-0.j-rollout.ml.svc.cluster.local") == ["10.9.0.3"]
    assert lookup("j-rollout-0") == []  # another pod's short name is not in DNS
    assert lookup("j-rollout.ml.svc") == lookup("j-rollout") == ["10.9.0.3"]
    assert "10.9.0.4" not in text  # a subdomain without a Service gets no record


def test_security_context_and_status_pieces() -> None:
    pod = {"spec": {"securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "fsGroup": 2000}}}
    c = {"securityContext": {"readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False}}
    sec = security(pod, c, Image())
    assert (sec["uid"], sec["gid"], sec["groups"], sec["read_only_root"], sec["no_new_privs"]) == (
        1000,
        1000,
        [2000],
        True,
        True,
    )
    with pytest.raises(PodStartError, match="runAsNonRoot"):
        security({"spec": {"securityContext": {"runAsNonRoot": True, "runAsUser": 0}}}, {}, Image())
    assert exit_code_of(-9) == 137 and exit_code_of(3) == 3
    done = container_status("c", "img", "terminated", ready=False, started="t", exit_code=137)
    assert done["state"]["terminated"]["exitCode"] == 137 and done["state"]["terminated"]["reason"] == "Error"
    assert container_status("c", "img", "terminated", ready=False, started="t", exit_code=0)["state"]["terminated"][
        "reason"
    ] == ("Completed")


# -- real pods ---------------------------------------------------------------------------------

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("nsenter") is None,
    reason="the node agent needs root, ip and nsenter (network and mount namespaces)",
)


def twin_namespace(plane: Any, name: str, labels: dict[str, str] | None = None) -> str:
    """A namespace of the real control plane where the twin can run pods. The control plane is
    MicroShift's build: its ServiceAccount admission adds the ConfigMap openshift-service-ca.crt
    (not optional) to every pod's kube-api-access volume, and the controller that publishes it is
    off (tests/control_plane.py); a kubelet holds such a pod in ContainerCreating. Publish it as
    that controller would (the service CA is the cluster's CA here)."""
    plane.namespace(name, labels=labels)
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "openshift-service-ca.crt", "namespace": name}}
    plane.apply({**cm, "data": {"service-ca.crt": plane.ca_file.read_text()}})
    return name


SERVER = textwrap.dedent(
    """
    import http.server, signal, sys
    def bye(*_):
        open("/data/web-terminated", "w").write("SIGTERM")
        sys.exit(0)
    signal.signal(signal.SIGTERM, bye)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"hello from web")
        def log_message(self, *a): pass
    http.server.HTTPServer(("0.0.0.0", 8000), H).serve_forever()
    """
)

CLIENT = textwrap.dedent(
    """
    import json, os, socket, time, urllib.request
    out = {"uid": os.getuid(), "groups": os.getgroups(), "hostname": socket.gethostname()}
    out["env"] = {k: os.environ.get(k) for k in ("GREETING", "TOKEN", "POD_IP", "POD_NAME", "DERIVED")}
    out["cm_file"] = open("/etc/cfg/greeting").read()
    try:
        open("/etc/should-not-write", "w")
        out["root_writable"] = True
    except OSError:
        out["root_writable"] = False
    open("/tmp/scratch", "w").write("ok")
    deadline = time.time() + 30
    while True:
        try:
            out["web_pod"] = socket.gethostbyname("web-0.web.NS.svc")
            out["web_svc"] = socket.gethostbyname("web.NS.svc.cluster.local")
            out["body"] = urllib.request.urlopen("http://web-0.web.NS.svc:8000/", timeout=2).read().decode()
            break
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.2)
    open("/data/client.json", "w").write(json.dumps(out))
    """
).replace("NS", NS)


def pod(name: str, code: str, **spec: Any) -> dict[str, Any]:
    container = {
        "name": "main",
        "image": "stand-in",
        "command": ["python", "-c", code],
        "ports": [{"name": "http", "containerPort": 8000}],
        "securityContext": {"readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False},
        "volumeMounts": [
            {"name": "cfg", "mountPath": "/etc/cfg"},
            {"name": "scratch", "mountPath": "/tmp"},
            {"name": "data", "mountPath": "/data"},
        ],
        **spec.pop("container", {}),
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": spec.pop("labels", {})},
        "spec": {
            "restartPolicy": "Never",
            "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "fsGroup": 2000},
            "containers": [container],
            "volumes": [
                {"name": "cfg", "configMap": {"name": "cfg"}},
                {"name": "scratch", "emptyDir": {}},
                {"name": "data", "persistentVolumeClaim": {"claimName": "shared"}},
            ],
            **spec,
        },
    }


async def pod_status(cluster: Cluster, name: str) -> Any:
    try:
        return (await cluster.call(cluster.core.read_namespaced_pod, name, NS)).status
    except Exception:
        return None


async def gone(cluster: Cluster, name: str) -> bool:
    return name not in {p.metadata.name for p in (await cluster.call(cluster.core.list_namespaced_pod, NS)).items}


@needs_root
@pytest.mark.kmock(cls=FastEmulator)
async def test_pods_run_talk_and_terminate_like_on_a_node(kmock: Any) -> None:
    prepare_emulator(kmock)
    cluster = Cluster(str(kmock.url))
    core = cluster.core
    await cluster.call(core.create_namespaced_config_map, NS, {"metadata": {"name": "cfg"}, "data": {"greeting": "hi"}})
    secret = {"metadata": {"name": "sec"}, "data": {"token": base64.b64encode(b"s3cret").decode()}}
    await cluster.call(core.create_namespaced_secret, NS, secret)
    service = {"metadata": {"name": "web"}, "spec": {"clusterIP": "None", "selector": {"app": "web"}}}
    await cluster.call(core.create_namespaced_service, NS, service)
    agent = NodeAgent(str(kmock.url), NS, probe_period_max=0.3)
    await agent.start()
    base, bridge, tag = agent.base, agent.network.bridge, agent.network.tag  # type: ignore[union-attr]
    try:
        web = pod(
            "web-0",
            SERVER,
            labels={"app": "web"},
            hostname="web-0",
            subdomain="web",
            terminationGracePeriodSeconds=5,
            container={"readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 5}},
        )
        env = [
            {"name": "GREETING", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "greeting"}}},
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "token"}}},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "DERIVED", "value": "$(POD_NAME)@$(POD_IP)"},
        ]
        client = pod("client", CLIENT, hostname="client", container={"env": env})
        failing = pod("failing", "import sys; sys.exit(3)")
        stubborn = pod(
            "stubborn",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)",
            terminationGracePeriodSeconds=1,
        )
        for p in (web, client, failing, stubborn):
            await cluster.call(core.create_namespaced_pod, NS, p)

        async def phase(name: str, want: str) -> Any:
            st = await pod_status(cluster, name)
            return st if st is not None and st.phase == want else None

        st = await eventually(lambda: phase("client", "Succeeded"), timeout=40, what="client Succeeded")
        assert st.container_statuses[0].state.terminated.exit_code == 0, agent.log_tail()
        out = json.loads((agent.claim_dir("shared") / "client.json").read_text())
        web_st = await eventually(lambda: phase("web-0", "Running"), what="web Running")
        web_ip = web_st.pod_ip
        assert out["uid"] == 1000 and 2000 in out["groups"] and out["hostname"] == "client"
        assert out["env"]["GREETING"] == "hi" and out["env"]["TOKEN"] == "s3cret"
        assert out["env"]["POD_NAME"] == "client" and out["env"]["DERIVED"] == f"client@{out['env']['POD_IP']}"
        assert out["cm_file"] == "hi" and out["root_writable"] is False
        assert out["web_pod"] == out["web_svc"] == web_ip and out["body"] == "hello from web"
        assert st.pod_ip == out["env"]["POD_IP"] != web_ip
        # a directory made by the twin for the claim: group-owned by fsGroup, as Kubernetes does
        assert (agent.claim_dir("shared").stat().st_gid, agent.claim_dir("shared").stat().st_uid) == (2000, 0)

        async def ready() -> Any:
            s = await pod_status(cluster, "web-0")
            return s and any(c.type == "Ready" and c.status == "True" for c in s.conditions)

        await eventually(ready, timeout=10, what="web Ready from its probe")
        st = await eventually(lambda: phase("failing", "Failed"), timeout=20, what="failing Failed")
        term = st.container_statuses[0].state.terminated
        assert (term.exit_code, term.reason) == (3, "Error")

        # Deletion: held by the twin's finalizer until the process is gone.
        await cluster.delete_pod("web-0")
        await eventually(lambda: gone(cluster, "web-0"), timeout=10, what="web-0 removed")
        assert (agent.claim_dir("shared") / "web-terminated").read_text() == "SIGTERM"
        started = time.monotonic()
        await cluster.delete_pod("stubborn")
        body = await cluster.call(core.read_namespaced_pod, "stubborn", NS)
        assert body.metadata.deletion_timestamp and FINALIZER in body.metadata.finalizers
        await eventually(lambda: gone(cluster, "stubborn"), timeout=10, what="stubborn SIGKILLed and removed")
        assert time.monotonic() - started >= 0.9  # it ignored SIGTERM: killed after its grace period
        pids = [r.proc.pid for r in agent.history if r.proc is not None]
    finally:
        await agent.close()
    # Nothing left behind.
    assert not base.exists()
    assert subprocess.run(["ip", "link", "show", bridge], capture_output=True).returncode != 0
    assert tag not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


# A stand-in image for the operator's pods: `kubedistill role ROLE ...` answers /health and
# /status on the HTTP port like the real roles, and the trainer exits 0 once /ckpt/finish exists.
FAKE_KUBEDISTILL = """#!{python}
import http.server, json, os, sys, time, threading
role = sys.argv[2]
cfg = json.load(open(sys.argv[4]))
start = time.time()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = {{"step": int(time.time() - start), "weightVersion": 0, "lastCheckpoint": None}}
        self.send_response(200); self.end_headers(); self.wfile.write(json.dumps(body).encode())
    def log_message(self, *a): pass
threading.Thread(target=http.server.HTTPServer(("0.0.0.0", 8000), H).serve_forever, daemon=True).start()
while not (role == "trainer" and os.path.exists("/ckpt/finish")):
    time.sleep(0.1)
"""


@needs_root
@pytest.mark.kmock(cls=FastEmulator)
async def test_the_operator_s_pods_run_restart_and_suspend(kmock: Any, tmp_path: Path) -> None:

    # Not under /tmp: every pod has its own scratch emptyDir there.
    image_dir = Path(tempfile.mkdtemp(prefix="stand-in-image-", dir="/var/tmp"))
    bin_dir = image_dir / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(Path(sys.executable))
    fake = bin_dir / "kubedistill"
    fake.write_text(FAKE_KUBEDISTILL.format(python=sys.executable))
    fake.chmod(0o755)
    image_dir.chmod(0o755)
    prepare_emulator(kmock)
    cluster = Cluster(str(kmock.url))
    spec = {
        "device": "cpu",
        "student": {"model": "/models/student"},
        "teachers": [{"name": "math", "model": "/models/teacher"}],
        "rollout": {"replicas": 1},
        "trainer": {"replicas": 1, "miniBatchSize": 4},
        "data": {"train": ["/data/train.jsonl"]},
        "volumes": [{"name": "ckpt", "persistentVolumeClaim": {"claimName": "ckpt"}}],
        "volumeMounts": [{"name": "ckpt", "mountPath": "/ckpt"}],
    }
    try:
        await _operator_story(kmock, cluster, spec, bin_dir)
    finally:
        shutil.rmtree(image_dir)


async def _operator_story(kmock: Any, cluster: Cluster, spec: dict[str, Any], bin_dir: Path) -> None:
    from kubedistill.operator.render import LABEL_ATTEMPT
    from node_agent import Image
    from operator_fixtures import job_manifest, running_operator

    async with NodeAgent(str(kmock.url), NS, image=Image(bin_dir=bin_dir), probe_period_max=0.3) as agent:
        async with running_operator(str(kmock.url), resync_seconds=0.3):
            await cluster.create_job(job_manifest("tw", spec))

            async def phase(want: str) -> Any:
                st = ((await cluster.job("tw")) or {}).get("status") or {}
                return st if st.get("phase") == want else None

            async def until(check: Any, what: str) -> Any:
                try:
                    return await eventually(check, timeout=20, what=what)
                except AssertionError as e:
                    raise AssertionError(f"{e}\n{agent.log_tail()}") from None

            st = await until(lambda: phase("Running"), "Running")
            st = await until(lambda: _step_seen(cluster), "the trainer's /status in the job's status")
            os.kill(agent.pid("tw-trainer-0"), signal.SIGKILL)

            async def restarted() -> Any:
                pods = await cluster.pods("tw")
                t0 = pods.get("tw-trainer-0")
                ok = (
                    t0 is not None
                    and t0.metadata.labels[LABEL_ATTEMPT] == "1"
                    and (t0.status or {})
                    and t0.status.phase == "Running"
                )
                return ok and await phase("Running")

            await until(restarted, "a new trainer gang running")
            old_ip = (await cluster.pods("tw"))["tw-rollout-0"].status.pod_ip
            await cluster.delete_pod("tw-rollout-0")

            async def replaced() -> Any:
                p = (await cluster.pods("tw")).get("tw-rollout-0")
                return p and p.status and p.status.phase == "Running" and p.status.pod_ip not in (None, old_ip)

            await until(replaced, "the rollout pod replaced")
            await cluster.patch_job("tw", {"spec": {"suspend": True}})

            async def suspended() -> Any:
                return await phase("Suspended") and not await cluster.pods("tw") and not agent.pods

            await until(suspended, "Suspended, every pod gone")
            await cluster.patch_job("tw", {"spec": {"suspend": False}})
            await until(lambda: phase("Running"), "Running again")
            (agent.claim_dir("ckpt") / "finish").write_text("")
            st = await until(lambda: phase("Succeeded"), "Succeeded")
            assert st["restarts"] == 1


async def _step_seen(cluster: Cluster) -> Any:
    st = ((await cluster.job("tw")) or {}).get("status") or {}
    return st.get("step", 0) >= 1


# -- as a kubelet on the real control plane ------------------------------------------------------

KUBELET_POD = textwrap.dedent(
    """
    import json, os, signal, sys, time
    sa = "/var/run/secrets/kubernetes.io/serviceaccount"
    out = {f: open(os.path.join(sa, f)).read() for f in sorted(os.listdir(sa))}
    out["node"] = os.environ["NODE"]
    def bye(*_):
        open("/out/terminated", "w").write("SIGTERM")
        sys.exit(0)
    signal.signal(signal.SIGTERM, bye)
    open("/out/report.json", "w").write(json.dumps(out))
    time.sleep(600)
    """
)


def _jwt_claims(token: str) -> dict[str, Any]:
    payload = token.split(".")[1]
    return dict(json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))))


@needs_root
async def test_on_a_real_server_it_runs_what_the_scheduler_binds_to_its_node(control_plane: Any) -> None:
    import kubernetes

    plane = control_plane
    plane.needs(SCHEDULER, CONTROLLERS, why="the scheduler binds the pods; node lifecycle")
    ns = twin_namespace(plane, "node-agent-twin")
    api = kubernetes.config.new_client_from_config(config_file=str(plane.kubeconfig))  # type: ignore[no-untyped-call]
    core = kubernetes.client.CoreV1Api(api)
    coordination = kubernetes.client.CoordinationV1Api(api)
    out = Path(tempfile.mkdtemp(prefix="twin-out-", dir="/var/tmp"))
    out.chmod(0o777)

    async def call(fn: Any, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(fn, *args, _request_timeout=10, **kwargs)

    async def read(name: str) -> Any:
        try:
            return await call(core.read_namespaced_pod, name, ns)
        except kubernetes.client.ApiException as e:
            if e.status == 404:
                return None
            raise

    agent = NodeAgent(ApiAccess.from_kubeconfig(plane.kubeconfig), ns, node=NodeRegistration(), probe_period_max=0.3)
    await agent.start()
    node = agent.node_name
    try:
        container = {
            "name": "main",
            "image": "stand-in",
            "command": ["python", "-c", KUBELET_POD],
            "env": [{"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
            "securityContext": {"readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False},
            "volumeMounts": [{"name": "out", "mountPath": "/out"}],
        }
        spec = {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 5,
            "securityContext": {"runAsNonRoot": True, "runAsUser": 1000},
            "containers": [container],
            "volumes": [{"name": "out", "hostPath": {"path": str(out), "type": "Directory"}}],
        }
        twin = {"metadata": {"name": "twin"}, "spec": {**spec, "tolerations": [TWIN_TOLERATION]}}
        stray = {"metadata": {"name": "stray"}, "spec": spec}  # what other tests' pods are like
        await call(core.create_namespaced_pod, ns, twin, field_validation="Strict")
        await call(core.create_namespaced_pod, ns, stray, field_validation="Strict")

        async def running() -> Any:
            p = await read("twin")
            return p if p.status.phase == "Running" and (out / "report.json").is_file() else None

        try:
            pod = await eventually(running, timeout=30, what="twin Running, its report written")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{agent.log_tail()}") from None
        assert pod.spec.node_name == node and pod.status.host_ip == agent.network.gateway  # type: ignore[union-attr]
        report = json.loads((out / "report.json").read_text())
        # The kube-api-access volume the ServiceAccount admission added: a token bound to this
        # pod, the cluster's CA, the namespace.
        assert report["node"] == node and report["namespace"] == ns
        assert report["ca.crt"] == plane.ca_file.read_text()
        bound = _jwt_claims(report["token"])["kubernetes.io"]
        assert (bound["namespace"], bound["pod"]["name"], bound["pod"]["uid"]) == (ns, "twin", pod.metadata.uid)

        async def unschedulable() -> Any:
            p = await read("stray")
            return [c for c in p.status.conditions or [] if c.type == "PodScheduled" and c.reason == "Unschedulable"]

        (cond,) = await eventually(unschedulable, timeout=10, what="stray refused by the scheduler")
        assert "untolerated taint" in cond.message and (await read("stray")).spec.node_name is None
        lease = await call(coordination.read_namespaced_lease, node, LEASE_NAMESPACE)
        assert lease.spec.holder_identity == node

        # Graceful deletion: the object stays (no finalizer holds it) until the twin, its process
        # gone after SIGTERM, deletes it with grace 0.
        await call(core.delete_namespaced_pod, "twin", ns)
        held = await read("twin")
        assert held.metadata.deletion_timestamp is not None and not held.metadata.finalizers
        await eventually(lambda: _none(read("twin")), timeout=15, what="twin deleted by the twin")
        assert (out / "terminated").read_text() == "SIGTERM"
        assert [r.exit_code for r in agent.history] == [0] and not agent.pods
        assert not agent.errors, agent.errors  # every request taken, strict field validation included
        await call(core.delete_namespaced_pod, "stray", ns)  # never bound: deleted at once
    finally:
        await agent.close()
        shutil.rmtree(out, ignore_errors=True)
        plane.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    with pytest.raises(kubernetes.client.ApiException) as gone_node:
        await call(core.read_node, node)
    assert gone_node.value.status == 404


async def _none(value: Any) -> bool:
    return await value is None
