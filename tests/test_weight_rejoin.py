"""A trainer restart while the rollout server keeps running (what the operator's gang restart and
`kubedistill run`'s trainer relaunch do): a trainer-side sender process syncs weights to a real
hf rollout server, begins another sync and is SIGKILLed in the middle of it; a new sender process
on the same address re-forms the group under a new epoch and syncs other weights, which the
server must then hold bit for bit. Repeated re-joins must not leak the old groups' sockets. And
the reverse: a replaced rollout server (new process, same address) is brought into a new group by
the living trainer's next sync."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import httpx
import torch

from kubedistill.api.roleconfig import JobConfig
from kubedistill.api.spec import DeltaMode
from server_fixtures import Server, free_port, job_config, retry_on_port_taken
from test_servers_hf import expected_checksums, perturbed

torch.set_num_threads(1)

# A trainer-side process: form the group, sync the weights of `seed` as version 1, then begin
# version 2 (every server enters the broadcast) and hang there until killed.
SENDER = """
import json, sys, time
import httpx, torch
torch.set_num_threads(1)
from kubedistill.api.roleconfig import JobConfig
from kubedistill.runtime.wire.protocol import WeightsBeginRequest
from kubedistill.runtime.weight_sync.sender import WeightSender, build_manifest
sys.path.insert(0, {tests!r})
from test_servers_hf import perturbed
cfg = JobConfig.load({config!r})
sender = WeightSender(cfg.spec, cfg.endpoints)
named = perturbed({student!r}, seed={seed})
sender.sync(1, named)
body = WeightsBeginRequest(version=2, manifest=build_manifest(named, 1 << 20), group_epoch=sender.epoch)
for url in cfg.endpoints.rollout:
    assert httpx.post(url + "/weights/begin", json=body.model_dump(mode="json"), timeout=60).status_code == 200
print(json.dumps({{"epoch": sender.epoch}}), flush=True)
time.sleep(600)
"""


def _open_sockets(pid: int) -> int:
    n = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            n += os.readlink(fd).startswith("socket:")
        except OSError:
            pass
    return n


class LoneRollout(NamedTuple):
    server: Server
    cfg: JobConfig
    config: Path
    """cfg on disk, for SENDER."""
    url: str
    port: int


def lone_rollout(models: dict[str, Path], tmp_path: Path, engine: str, delta: DeltaMode | None = None) -> LoneRollout:
    """The rollout server of a one-replica job (weightSync.delta.mode `delta`, else the default),
    started and answering /health: its port is its own from then on."""

    def start() -> LoneRollout:
        port, wport = free_port(), free_port()
        url = f"http://127.0.0.1:{port}"
        cfg = job_config(
            models["student"],
            models["teacher"],
            engine=engine,
            rollout_urls=[url],
            teacher_urls=["http://127.0.0.1:1"],
            weight_sync_port=wport,
        )
        if delta is not None:
            cfg.spec.weight_sync.delta.mode = delta
        config = tmp_path / "config.json"
        cfg.dump(config)
        server = Server("rollout", config, port)
        try:
            server.wait_healthy()
        except BaseException:
            server.stop()
            raise
        return LoneRollout(server, cfg, config, url, port)

    return retry_on_port_taken(start)


def start_sender(models: dict[str, Path], config: Path) -> subprocess.Popen[str]:
    """A trainer-side SENDER process: it syncs version 1, prints its epoch and stalls in version 2."""
    code = SENDER.format(tests=str(Path(__file__).parent), config=str(config), student=str(models["student"]), seed=11)
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1")
    )


SENDER_SECONDS = 180.0
"""How long a SENDER may take to print its epoch (it imports torch, forms the group and syncs the
tiny student once: seconds, a minute on a starved machine)."""


def sender_epoch(sender: subprocess.Popen[str], server: Server) -> str:
    """The epoch SENDER prints once the server is inside its version-2 broadcast. Fails (and kills
    it) if it ends or stays silent for SENDER_SECONDS, rather than waiting on it for good."""
    assert sender.stdout is not None
    ready, _, _ = select.select([sender.stdout], [], [], SENDER_SECONDS)
    line = sender.stdout.readline() if ready else ""
    if not line:
        sender.kill()
        raise AssertionError(
            f"the sender printed no epoch within {SENDER_SECONDS:.0f} s (exit code {sender.poll()}); "
            f"server log:\n{server.log()[-3000:]}"
        )
    return str(json.loads(line)["epoch"])


def test_rollout_server_rejoins_after_trainer_sigkill(tiny_models, tmp_path: Path) -> None:
    # Delta syncs on (off by default): each new sender's first sync restarts the chain (keep).
    server, cfg, config, url, port = lone_rollout(tiny_models, tmp_path, "hf", DeltaMode.always)
    sender_proc = None
    try:
        sender_proc = start_sender(tiny_models, config)
        first_epoch = sender_epoch(sender_proc, server)  # the server is inside the version-2 broadcast now
        assert httpx.get(url + "/version").json()["version"] == 1
        assert httpx.get(url + "/weights/checksums", timeout=60).json() == expected_checksums(
            perturbed(tiny_models["student"], seed=11)
        )
        assert httpx.get(url + "/weights/group").json() == {
            "epoch": first_epoch,
            "state": "ready",
            "error": None,
            "dtype": "float32",
            "in_place": True,  # the hf engine: large tensors travel alone, straight into its parameters
            "delta_base": None,  # inside the version-2 load, which may never complete: no base
            "served_at_load": True,  # the hf engine serves a load before the sync's last all-reduce
        }
        os.kill(sender_proc.pid, signal.SIGKILL)
        sender_proc.wait(30)

        # The new trainer: same address, new process, new epoch.
        from kubedistill.runtime.weight_sync.sender import WeightSender

        t0 = time.monotonic()
        sender = WeightSender(cfg.spec, cfg.endpoints)
        rejoin_seconds = time.monotonic() - t0
        assert sender.epoch != first_epoch
        assert httpx.get(url + "/weights/group").json() == {
            "epoch": sender.epoch,
            "state": "ready",
            "error": None,
            "dtype": "float32",
            "in_place": True,
            "delta_base": None,  # the aborted sync broke the chain
            "served_at_load": True,
        }
        # The interrupted version-2 sync failed on the server; it never loaded.
        last = httpx.get(url + "/weights/last").json()
        assert last["version"] == 2 and "error" in last, last
        named = perturbed(tiny_models["student"], seed=12)
        sender.sync(3, named)
        assert sender.last_delta.plan == "keep"  # a full sync restarts the chain
        assert httpx.get(url + "/version").json()["version"] == 3
        assert httpx.get(url + "/weights/checksums", timeout=60).json() == expected_checksums(named)
        assert rejoin_seconds < 30, rejoin_seconds

        # A begin carrying another group's epoch is refused without entering a collective.
        stale = httpx.post(
            url + "/weights/begin",
            json={
                "version": 4,
                "manifest": {"bucket_bytes": 1, "tensors": [], "buckets": []},
                "group_epoch": first_epoch,
            },
        )
        assert stale.status_code == 503 and first_epoch in stale.json()["error"]

        # Many trainer restarts: each re-join releases the previous group's sockets.
        sender.close()
        sockets = []
        for i in range(5):
            sender = WeightSender(cfg.spec, cfg.endpoints)
            sender.sync(4 + i, perturbed(tiny_models["student"], seed=20 + i))
            sender.close()
            sockets.append(_open_sockets(server.proc.pid))
        # a leaked group would add its sockets at every restart (a spread of 4+ over 5 restarts)
        assert max(sockets) - min(sockets) <= 2, f"open sockets of the rollout server grew: {sockets}"
        sender = WeightSender(cfg.spec, cfg.endpoints)
        sender.sync(9, perturbed(tiny_models["student"], seed=25))
        assert httpx.get(url + "/weights/checksums", timeout=60).json() == expected_checksums(
            perturbed(tiny_models["student"], seed=25)
        )
        assert httpx.get(url + "/health").json()["status"] == "ok"

        # The other way round: the rollout server is replaced (a new pod behind the same Service)
        # while the trainer lives on; its next sync re-forms the group instead of failing.
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait(30)
        server = Server("rollout", config, port, log_path=tmp_path / "rollout-replaced.log")
        server.wait_healthy(120)
        assert httpx.get(url + "/weights/group").json()["epoch"] is None
        named = perturbed(tiny_models["student"], seed=30)
        sender.sync(10, named)
        assert sender.reforms == 1
        assert sender.last_delta.plan == "keep"  # the new server holds no base: a full sync
        group = httpx.get(url + "/weights/group").json()
        assert group.pop("delta_base")["version"] == 10
        assert group == {
            "epoch": sender.epoch,
            "state": "ready",
            "error": None,
            "dtype": "float32",
            "in_place": True,
            "served_at_load": True,
        }
        assert httpx.get(url + "/weights/checksums", timeout=60).json() == expected_checksums(named)
        sender.close()
    finally:
        if sender_proc is not None and sender_proc.poll() is None:
            sender_proc.kill()
        server.stop()
