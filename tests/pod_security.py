"""The Pod Security Standards' "restricted" profile (latest), checked offline for tests.

The API server's PodSecurity admission refuses a pod in a namespace labelled
`pod-security.kubernetes.io/enforce=restricted` for any of these; each check returns the
problems as the admission message would name them. The rules follow the standard's table
(baseline controls, then the restricted ones).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

BASELINE_CAPABILITIES = {
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "NET_BIND_SERVICE",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
}
RESTRICTED_VOLUME_KINDS = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
    "net.ipv4.tcp_rmem",
    "net.ipv4.tcp_wmem",
}
SELINUX_TYPES = {None, "", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def _containers(spec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for key in ("initContainers", "containers", "ephemeralContainers"):
        yield from spec.get(key) or []


def _handlers(c: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        if c.get(probe):
            yield c[probe]
    yield from (c.get("lifecycle") or {}).values()


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """Why PodSecurity "restricted:latest" would refuse this pod; empty when it admits it."""
    spec = pod["spec"]
    psc = spec.get("securityContext") or {}
    out: list[str] = []
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            out.append(f"host namespaces ({field}=true)")
    if (psc.get("windowsOptions") or {}).get("hostProcess"):
        out.append("hostProcess")
    for v in spec.get("volumes") or []:
        kinds = set(v) - {"name"}
        if "hostPath" in kinds:
            out.append(f"hostPath volume {v['name']!r}")
        elif not kinds <= RESTRICTED_VOLUME_KINDS:
            out.append(f"restricted volume types ({v['name']!r} uses {sorted(kinds)})")
    for s in psc.get("sysctls") or []:
        if s.get("name") not in SAFE_SYSCTLS:
            out.append(f"forbidden sysctl {s.get('name')}")
    if psc.get("runAsUser") == 0:
        out.append("runAsUser=0")
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type")
    if pod_seccomp == "Unconfined":
        out.append("seccompProfile type Unconfined")
    if (psc.get("appArmorProfile") or {}).get("type") == "Unconfined":
        out.append("appArmorProfile Unconfined")
    if (psc.get("seLinuxOptions") or {}).get("type") not in SELINUX_TYPES:
        out.append("seLinuxOptions type")
    for c in _containers(spec):
        name = c.get("name", "?")
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            out.append(f"privileged container {name!r}")
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            out.append(f"hostProcess container {name!r}")
        for p in c.get("ports") or []:
            if p.get("hostPort"):
                out.append(f"hostPort {p['hostPort']} in container {name!r}")
        if sc.get("procMount") not in (None, "Default"):
            out.append(f"procMount in container {name!r}")
        if (sc.get("appArmorProfile") or {}).get("type") == "Unconfined":
            out.append(f"appArmorProfile Unconfined in container {name!r}")
        if (sc.get("seLinuxOptions") or {}).get("type") not in SELINUX_TYPES:
            out.append(f"seLinuxOptions type in container {name!r}")
        for h in _handlers(c):
            for action in ("httpGet", "tcpSocket"):
                host = (h.get(action) or {}).get("host")
                if host not in (None, "", "127.0.0.1", "::1", "localhost"):
                    out.append(f"probe or lifecycle host {host!r} in container {name!r}")
        caps = sc.get("capabilities") or {}
        added = set(caps.get("add") or [])
        if added - BASELINE_CAPABILITIES:
            out.append(f"non-default capabilities {sorted(added - BASELINE_CAPABILITIES)} in {name!r}")
        # restricted
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"allowPrivilegeEscalation != false (container {name!r})")
        if "ALL" not in (caps.get("drop") or []) or added - {"NET_BIND_SERVICE"}:
            out.append(f"unrestricted capabilities (container {name!r} must drop ALL, add at most NET_BIND_SERVICE)")
        non_root = sc.get("runAsNonRoot", psc.get("runAsNonRoot"))
        if non_root is not True:
            out.append(f"runAsNonRoot != true (container {name!r})")
        if sc.get("runAsUser") == 0:
            out.append(f"runAsUser=0 (container {name!r})")
        seccomp = (sc.get("seccompProfile") or {}).get("type") or pod_seccomp
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"seccompProfile (container {name!r} must use RuntimeDefault or Localhost)")
    return out
