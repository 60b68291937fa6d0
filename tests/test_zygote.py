"""The role fork server (runtime/entrypoints/zygote.py): a forked role behaves as the fresh
`python -m|-c` process it replaces, and what a fork could not honour is spawned instead.
(Launching, polling and stopping forked roles: tests/test_supervisor.py; every `kubedistill run`
in the end-to-end tests forks its roles from one.)"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kubedistill.runtime.entrypoints import zygote as zygote_module
from kubedistill.runtime.entrypoints.zygote import Forked, Zygote, fork_blockers, python_entry


def test_only_variables_read_after_import_may_differ_from_the_zygote() -> None:
    base = {"PATH": "/bin", "HOME": "/root", "OMP_NUM_THREADS": "8"}
    role = {
        **base,
        "OMP_NUM_THREADS": "1",
        "KUBEDISTILL_ROLE": "trainer",
        "RANK": "0",
        "MASTER_PORT": "1234",
        "CUDA_VISIBLE_DEVICES": "1",
        "NCCL_NET": "Socket",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    assert fork_blockers(base, role) == []
    # a user's variable that torch or transformers reads at import, set, changed or removed
    assert fork_blockers(base, {**role, "TORCH_LOGS": "+dynamo", "HOME": "/home/u"}) == ["HOME", "TORCH_LOGS"]
    assert fork_blockers(base, {k: v for k, v in role.items() if k != "PATH"}) == ["PATH"]


def test_python_entry_takes_this_interpreters_module_or_code() -> None:
    assert python_entry([sys.executable, "-m", "kubedistill.cli", "role", "trainer"]) == (
        "-m",
        "kubedistill.cli",
        ["role", "trainer"],
    )
    assert python_entry([sys.executable, "-c", "pass"]) == ("-c", "pass", [])
    assert python_entry(["/usr/bin/python3.9", "-m", "x"]) is None
    assert python_entry([sys.executable, "script.py"]) is None


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    z = Zygote(preload=("torch", "numpy"))
    yield z
    z.close()


def _run(zygote: Zygote, tmp_path: Path, name: str, argv: list[str], env: dict[str, str] | None = None) -> str:
    log = tmp_path / f"{name}.log"
    child = zygote.fork(name, argv, {**zygote.env, **(env or {})}, str(tmp_path), str(log))
    assert isinstance(child, Forked)
    child.wait(60)
    return f"{child.poll()}|{log.read_text()}"


def test_a_forked_role_ends_as_a_fresh_interpreter_would(zygote: Zygote, tmp_path: Path) -> None:
    py = sys.executable
    # its threads joined, then atexit handlers, then buffers flushed; stdin is empty
    code = (
        "import atexit, sys, threading, time\n"
        "atexit.register(lambda: print('atexit', flush=False))\n"
        "threading.Thread(target=lambda: (time.sleep(0.3), print('thread'))).start()\n"
        "print('main', sys.argv, repr(sys.stdin.read()), end=' ')\n"
    )
    assert _run(zygote, tmp_path, "ok", [py, "-c", code, "x"]) == "0|main ['-c', 'x'] '' thread\natexit\n"
    exc = _run(zygote, tmp_path, "exc", [py, "-c", "raise ValueError('bad')"])
    assert exc.startswith("1|Traceback") and exc.endswith("ValueError: bad\n")
    assert _run(zygote, tmp_path, "msg", [py, "-c", "raise SystemExit('no config')"]) == "1|no config\n"
    # a module runs as __main__ with its arguments, in the requested working directory
    (tmp_path / "here.txt").write_text("")
    assert _run(zygote, tmp_path, "mod", [py, "-m", "kubedistill.cli", "validate", "nope.yaml"]).startswith("1|")
    assert _run(zygote, tmp_path, "cwd", [py, "-c", "print(open('here.txt').read() or 'found')"]) == "0|found\n"


def test_a_forked_role_gets_its_threads_seed_name_and_command_line(zygote: Zygote, tmp_path: Path) -> None:
    py = sys.executable
    show = (
        "import os, torch, numpy\n"
        "print(torch.get_num_threads(), numpy.random.randint(1 << 30), open('/proc/self/comm').read().strip(),\n"
        "      open('/proc/self/cmdline', 'rb').read().split(b'\\0')[:2], os.getsid(0) == os.getpid())\n"
    )
    one = _run(zygote, tmp_path, "role-a", [py, "-c", show, "--config"], {"OMP_NUM_THREADS": "1"})
    two = _run(zygote, tmp_path, "role-b", [py, "-c", show, "--config"], {"OMP_NUM_THREADS": "2"})
    (t1, r1, n1, rest1), (t2, r2, n2, rest2) = (s.split(" ", 3) for s in (one, two))
    assert (t1, n1) == ("0|1", "role-a") and (t2, n2) == ("0|2", "role-b")  # exit code 0|threads
    assert r1 != r2  # numpy's global generator is seeded per process, not inherited
    # ps and pgrep -f see the role's command line (as much of it as fits the zygote's)
    assert rest1 == rest2 == f"{[sys.executable.encode(), b'-c']} True\n"


def test_what_a_fork_cannot_honour_is_not_forked(zygote: Zygote, tmp_path: Path) -> None:
    env = {**zygote.env, "TORCH_LOGS": "+dynamo"}  # torch read it at the zygote's import
    assert zygote.fork("a", [sys.executable, "-c", "pass"], env, str(tmp_path), str(tmp_path / "a.log")) is None
    assert zygote.fork("b", ["/bin/true"], zygote.env, str(tmp_path), str(tmp_path / "b.log")) is None


def test_the_roles_end_with_their_zygote(tmp_path: Path) -> None:
    zygote = Zygote(preload=())
    child = zygote.fork(
        "sleeper", [sys.executable, "-c", "import time; time.sleep(600)"], dict(os.environ), str(tmp_path), "/dev/null"
    )
    assert child is not None and child.poll() is None
    zygote.proc.kill()  # as when the launcher is killed: its zygote's stdin closes, or it dies
    assert child.wait(20) == -signal.SIGTERM
    assert zygote.fork("late", [sys.executable, "-c", "pass"], dict(os.environ), str(tmp_path), "/dev/null") is None
    zygote.close()


def test_a_zygote_not_ready_in_time_is_ended_and_its_roles_spawned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(zygote_module, "READY_SECONDS", 0.2)
    zygote = Zygote(preload=("torch",))  # seconds of imports
    argv = [sys.executable, "-c", "pass"]
    assert zygote.fork("late", argv, zygote.env, str(tmp_path), "/dev/null") is None
    assert zygote.proc.wait(20) == -signal.SIGKILL
    assert zygote.fork("later", argv, zygote.env, str(tmp_path), "/dev/null") is None
    zygote.close()
