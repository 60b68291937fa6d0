"""The operator's own Kubernetes client (operator/kube.py): which credentials it sends.

The real server's side (the chart's ServiceAccount token, the in-cluster loader, a revoked
token) is in tests/test_k8s_operator.py; these cases pin the header and the one retry after a
401 without a cluster."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import aiohttp.web
import pytest
import yaml

from kubedistill.operator.handlers import connection_info
from kubedistill.operator.kube import Kube, KubeConfig, KubeError, client_configuration
from operator_fixtures import serving


def write_kubeconfig(path: Path, user: dict[str, Any], server: str = "http://127.0.0.1:1", **cluster: Any) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": server, **cluster}}],
                "users": [{"name": "u", "user": user}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    return path


@pytest.fixture
def kubeconfig_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """KUBECONFIG at a file of this test, and no in-cluster service account."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    path = tmp_path / "kubeconfig"
    monkeypatch.setenv("KUBECONFIG", str(path))
    return path


def test_a_kubeconfig_token_is_sent_as_a_bearer_header(kubeconfig_env: Path) -> None:
    write_kubeconfig(kubeconfig_env, {"token": "abc.def"})
    assert KubeConfig.load().headers() == {"Authorization": "Bearer abc.def"}


def test_a_kubeconfig_token_file_is_sent_as_a_bearer_header(kubeconfig_env: Path, tmp_path: Path) -> None:
    (tmp_path / "token").write_text("from-a-file\n")
    write_kubeconfig(kubeconfig_env, {"tokenFile": str(tmp_path / "token")})
    assert KubeConfig.load().headers() == {"Authorization": "Bearer from-a-file"}


def test_no_token_sends_no_authorization_header(kubeconfig_env: Path) -> None:
    write_kubeconfig(kubeconfig_env, {})
    assert KubeConfig.load().headers() == {}


def test_insecure_skip_tls_verify_turns_verification_off(kubeconfig_env: Path) -> None:
    write_kubeconfig(kubeconfig_env, {"token": "t"}, server="https://127.0.0.1:1", **{"insecure-skip-tls-verify": True})
    ctx = KubeConfig.load().ssl_context
    assert ctx is not None and ctx.verify_mode == ssl.CERT_NONE and not ctx.check_hostname


async def test_a_401_loads_the_credentials_again_once() -> None:
    """A rotated token: the server refuses the old one; the reloaded config's token passes.
    A second 401 (the new token is refused too) is the caller's error, not a loop."""
    accepted = {"Bearer new"}
    seen: list[str] = []

    async def status(request: aiohttp.web.Request) -> aiohttp.web.Response:
        token = request.headers.get("Authorization", "")
        seen.append(token)
        if token not in accepted:
            return aiohttp.web.json_response({"kind": "Status", "message": "Unauthorized", "code": 401}, status=401)
        return aiohttp.web.json_response({})

    app = aiohttp.web.Application()
    app.router.add_patch("/apis/kubedistill.io/v1alpha1/namespaces/ml/distillationjobs/j/status", status)
    loads: list[str] = []

    def config(server: str, token: str, then: str) -> KubeConfig:
        def reload() -> KubeConfig:
            loads.append(then)
            return config(server, then, then)

        return KubeConfig(server=server, headers=lambda: {"Authorization": f"Bearer {token}"}, reload=reload)

    async with serving(app) as port:
        kube = Kube(config(f"http://127.0.0.1:{port}", "old", "new"))
        await kube.patch_status("ml", "j", {"phase": "Running"})
        assert seen == ["Bearer old", "Bearer new"] and loads == ["new"]

        accepted.clear()
        seen.clear()
        with pytest.raises(KubeError) as refused:
            await kube.patch_status("ml", "j", {"phase": "Running"})
        assert refused.value.status == 401 and seen == ["Bearer new", "Bearer new"]
        await kube.close()


def test_kopf_logs_in_with_the_same_token_without_its_newline(kubeconfig_env: Path, tmp_path: Path) -> None:
    (tmp_path / "token").write_text("from-a-file\n")
    write_kubeconfig(kubeconfig_env, {"tokenFile": str(tmp_path / "token")}, server="https://127.0.0.1:6443")
    info = connection_info(client_configuration())
    assert (info.server, info.scheme, info.token) == ("https://127.0.0.1:6443", "Bearer", "from-a-file")
