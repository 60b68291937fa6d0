"""A small asyncio client for the few Kubernetes calls the operator makes on the job's children.

kopf watches and patches the DistillationJob itself; creating/deleting children and polling the
trainer happen here on aiohttp (kopf's own HTTP stack), so hundreds of jobs reconcile
concurrently without a thread per call. Credentials come from the kubernetes client's loaders
(in-cluster service account, else kubeconfig): a bearer token is refreshed as the client's
loaders do, and a 401 loads the credentials again, so rotated and revoked tokens recover.

Not kubernetes_asyncio: prototyped for these calls (its typed APIs, plus CustomObjectsApi for
PodGroups and the job), it cost more operator CPU per job in bench/operator.py --jobs 100 than
this client, with a p95 no better (it walks every body into and out of its models), and
would be a second copy of the credential loaders that kopf's login shares with this client.
docs/operator.md#the-operators-kubernetes-client has the numbers.
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kubedistill.api.job import GROUP, PLURAL, VERSION


@dataclass(frozen=True)
class Resource:
    """A kind the operator writes, as the API serves it: the one place its group/version and
    plural are named (the paths here and the watches in operator/handlers.py derive from it)."""

    kind: str
    group_version: str
    """"v1" for the core group, else "group/version"."""
    plural: str

    @property
    def group(self) -> str:
        """The API group ("" for the core group), as RBAC rules name it."""
        return self.group_version.rpartition("/")[0]

    def collection(self, namespace: str) -> str:
        prefix = "/api/v1" if self.group_version == "v1" else f"/apis/{self.group_version}"
        return f"{prefix}/namespaces/{namespace}/{self.plural}"


POD = Resource("Pod", "v1", "pods")
CHILDREN: tuple[Resource, ...] = (
    POD,
    Resource("Service", "v1", "services"),
    Resource("ConfigMap", "v1", "configmaps"),
    Resource("NetworkPolicy", "networking.k8s.io/v1", "networkpolicies"),
)
"""The children the operator watches (label-selected), creates, patches and deletes."""
JOB = Resource("DistillationJob", f"{GROUP}/{VERSION}", PLURAL)
RESOURCES: dict[str, Resource] = {r.kind: r for r in (*CHILDREN, JOB)}
UNWATCHED: dict[str, str] = {"PodGroup": "podgroups", "PersistentVolumeClaim": "persistentvolumeclaims"}
"""kind -> plural of children the operator only creates and patches (never lists, watches or
deletes: the job's owner reference deletes them, or nothing for a retained checkpoint claim), under
the apiVersion the object names. A PodGroup's kind is served by two projects (Volcano,
scheduler-plugins), hence no fixed API prefix here."""


class KubeError(Exception):
    """An API call failed; `status` is the HTTP status (0 when the server was unreachable),
    `detail` the API server's own message (a Status object's `message`)."""

    def __init__(self, status: int, message: str, detail: str = ""):
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status
        self.detail = detail or message


@dataclass
class KubeConfig:
    server: str
    ssl_context: ssl.SSLContext | None = None
    headers: Callable[[], dict[str, str]] = field(default=lambda: {})
    reload: Callable[[], KubeConfig] | None = None
    """Loads the credentials again (after a 401: the token was rotated or revoked)."""

    @classmethod
    def plain(cls, server: str) -> KubeConfig:
        """An unauthenticated HTTP server (the KMock emulator in tests and benchmarks)."""
        return cls(server=server.rstrip("/"))

    @classmethod
    def load(cls) -> KubeConfig:
        """In-cluster service account, else the current kubeconfig context."""
        cfg = client_configuration()
        ctx: ssl.SSLContext | None = None
        if cfg.host.startswith("https"):
            ctx = ssl.create_default_context(cafile=cfg.ssl_ca_cert)
            if not cfg.verify_ssl:  # the kubeconfig's insecure-skip-tls-verify
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            if cfg.cert_file:
                ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
        return cls(server=cfg.host.rstrip("/"), ssl_context=ctx, headers=lambda: bearer_header(cfg), reload=cls.load)


def client_configuration() -> Any:
    """A kubernetes client Configuration: the in-cluster service account, else the current
    kubeconfig context. Both the operator's own client and kopf's login read it."""
    from kubernetes import client, config

    cfg = client.Configuration()
    # kubernetes ships py.typed but leaves its config loaders unannotated.
    try:
        config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    except config.ConfigException:
        # The client reads $KUBECONFIG once, at import: name the file as the environment has it now.
        config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=os.environ.get("KUBECONFIG"), client_configuration=cfg
        )
    return cfg


def bearer_header(cfg: Any) -> dict[str, str]:
    """The Authorization header of a loaded kubernetes client Configuration. The client keeps
    the token under "BearerToken" (since 36.0.1; "authorization" before), from a kubeconfig
    and in-cluster alike; auth_settings() reads either and runs the refresh hook, through which
    the in-cluster loader re-reads its (rotated) token file every minute. Its value carries
    the scheme ("Bearer ...")."""
    auth = cfg.auth_settings().get("BearerToken")
    # The client keeps a kubeconfig tokenFile's trailing newline, which no header may carry.
    token = str(auth["value"]).strip() if auth else ""
    return {"Authorization": token} if token else {}


def collection_path(kind: str, namespace: str) -> str:
    return RESOURCES[kind].collection(namespace)


def object_collection_path(obj: Mapping[str, Any]) -> str:
    """Where an object is created: by kind, or for UNWATCHED kinds by its own apiVersion."""
    kind, namespace = obj["kind"], obj["metadata"]["namespace"]
    if kind in UNWATCHED:
        prefix = "/api/v1" if obj["apiVersion"] == "v1" else f"/apis/{obj['apiVersion']}"
        return f"{prefix}/namespaces/{namespace}/{UNWATCHED[kind]}"
    return collection_path(kind, namespace)


class Kube:
    def __init__(self, config: KubeConfig, timeout: float = 30.0):
        self.config = config
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None
        self._lock = asyncio.Lock()

    async def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            async with self._lock:
                if self._session is None or self._session.closed:
                    connector = aiohttp.TCPConnector(limit=64, ssl=self.config.ssl_context or False)
                    self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _call(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json", answer: bool = True
    ) -> Any:
        """The answer's JSON (None without `answer`: the caller needs only the status)."""
        try:
            return await self._request(method, path, body, content_type, answer)
        except KubeError as exc:
            if exc.status != 401 or self.config.reload is None:
                raise
        # Unauthorized: the token was rotated or revoked. Load the credentials again, once.
        self.config = self.config.reload()
        await self.close()
        return await self._request(method, path, body, content_type, answer)

    async def _request(self, method: str, path: str, body: Any, content_type: str, answer: bool) -> Any:
        http = await self._http()
        headers = {"Accept": "application/json", **self.config.headers()}
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body).encode()
        try:
            async with http.request(method, self.config.server + path, data=data, headers=headers) as resp:
                raw = await resp.read()
                if resp.status >= 400:
                    text = raw.decode(errors="replace")
                    try:
                        message = str(json.loads(text).get("message", text))
                    except (ValueError, AttributeError):
                        message = text
                    raise KubeError(resp.status, f"{method} {path}: {message[:300]}", message[:1000])
                return json.loads(raw) if raw and answer else None
        except aiohttp.ClientError as exc:
            raise KubeError(0, f"{method} {path}: {exc}") from exc

    async def create(self, obj: Mapping[str, Any]) -> bool:
        """Create; False when it already exists (409 is success: reconciling twice is harmless)."""
        path = object_collection_path(obj)
        try:
            # The created object comes back whole (a pod's is several kB): parsing it was wasted.
            await self._call("POST", path, obj, answer=False)
        except KubeError as exc:
            if exc.status == 409:
                return False
            raise
        return True

    async def serves(self, group_version: str, plural: str | None = None) -> bool:
        """Whether the API server serves an API group (`group`) or a group version (`group/version`),
        and in it the resource `plural` if given: discovery, which every authenticated client may
        read (system:discovery)."""
        try:
            doc = await self._call("GET", f"/apis/{group_version}")
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        if plural is None:
            return True
        return any(r.get("name") == plural for r in (doc or {}).get("resources") or [])

    async def delete(self, kind: str, namespace: str, name: str) -> bool:
        """Delete (background propagation); False when it is already gone."""
        path = f"{collection_path(kind, namespace)}/{name}"
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        try:
            await self._call("DELETE", path, body, answer=False)
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def patch(self, obj: Mapping[str, Any], patch: Mapping[str, Any]) -> bool:
        """JSON merge patch of an existing child (named by `obj`, as for create); False when it
        is gone (the next pass creates it again)."""
        path = f"{object_collection_path(obj)}/{obj['metadata']['name']}"
        try:
            await self._call("PATCH", path, patch, "application/merge-patch+json", answer=False)
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def patch_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        path = f"{collection_path('DistillationJob', namespace)}/{name}/status"
        await self._call("PATCH", path, {"status": status}, "application/merge-patch+json", answer=False)


async def fetch_json(session: aiohttp.ClientSession, url: str, timeout: float) -> dict[str, Any] | None:
    """GET a JSON object from a pod; None on any failure (the pod may not be up yet)."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                return None
            doc = await resp.json(content_type=None)
            return doc if isinstance(doc, dict) else None
    except (TimeoutError, aiohttp.ClientError, ValueError):
        return None
