"""The role fork server (runtime/entrypoints/zygote.py, on multiprocessing's forkserver): a forked
role behaves as the fresh `python -m|-c` process it replaces, what a fork could not honour is
spawned instead, and every role ends with the `kubedistill run` that started it.
(Launching, polling and stopping forked roles: tests/test_supervisor.py; every `kubedistill run`
in the end-to-end tests forks its roles from one.)"""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kubedistill.runtime.entrypoints.zygote import (
    GONE,
    Forked,
    Zygote,
    _pidfd_of_parent,
    _running,
    fork_blockers,
    python_entry,
)
from server_fixtures import zygote_handle

ROOT = Path(__file__).resolve().parent.parent


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
    z = zygote_handle()  # the session's fork server, which the test servers fork from too
    yield z
    z.close()


def _run(zygote: Zygote, tmp_path: Path, name: str, argv: list[str], env: dict[str, str] | None = None) -> str:
    log = tmp_path / f"{name}.log"
    child = zygote.fork(name, argv, {**zygote.env, **(env or {})}, str(tmp_path), str(log))
    assert isinstance(child, Forked)
    return f"{child.wait(60)}|{log.read_text()}"


def test_a_forked_role_ends_as_a_fresh_interpreter_would(zygote: Zygote, tmp_path: Path) -> None:
    py = sys.executable
    # its threads joined, then logging shut down (a buffered handler flushed), stdout flushed;
    # stdin is empty; atexit handlers are not run (multiprocessing's children end without them)
    code = (
        "import atexit, logging, logging.handlers, sys, threading, time\n"
        "out = logging.StreamHandler(sys.stdout)\n"
        "logging.getLogger().addHandler(logging.handlers.MemoryHandler(100, target=out))\n"
        "logging.getLogger().warning('logged')\n"
        "atexit.register(lambda: print('atexit'))\n"
        "threading.Thread(target=lambda: (time.sleep(0.3), print('thread'))).start()\n"
        "print('main', sys.argv, repr(sys.stdin.read()), end=' ')\n"
    )
    assert _run(zygote, tmp_path, "ok", [py, "-c", code, "x"]) == "0|main ['-c', 'x'] '' thread\nlogged\n"
    exc = _run(zygote, tmp_path, "exc", [py, "-c", "raise ValueError('bad')"])
    assert exc.startswith("1|Traceback") and exc.endswith("ValueError: bad\n")
    assert _run(zygote, tmp_path, "msg", [py, "-c", "raise SystemExit('no config')"]) == "1|no config\n"
    assert _run(zygote, tmp_path, "code", [py, "-c", "import sys; sys.exit(7)"]) == "7|"
    # a module runs as __main__ with its arguments, in the requested working directory, which
    # is first on its sys.path as in a fresh `python -m`
    (tmp_path / "here.py").write_text("import sys; print(sys.argv[1:], __name__)")
    assert _run(zygote, tmp_path, "mod", [py, "-m", "here", "a"]) == "0|['a'] __main__\n"
    assert _run(zygote, tmp_path, "cli", [py, "-m", "kubedistill.cli", "validate", "nope.yaml"]).startswith("1|")


def test_a_forked_role_gets_its_threads_seed_name_and_command_line(zygote: Zygote, tmp_path: Path) -> None:
    py = sys.executable
    show = (
        "import os, sys, torch, numpy\n"
        "cmd = open('/proc/self/cmdline', 'rb').read().rstrip(b'\\0')\n"
        "print(torch.get_num_threads(), numpy.random.randint(1 << 30), open('/proc/self/comm').read().strip(),\n"
        "      cmd.startswith(sys.executable.encode() + b' -c import os') and cmd.endswith(b' --config x'),\n"
        "      os.getsid(0) == os.getpid())\n"
    )
    one = _run(zygote, tmp_path, "role-a", [py, "-c", show, "--config", "x"], {"OMP_NUM_THREADS": "1"})
    two = _run(zygote, tmp_path, "role-b", [py, "-c", show, "--config", "x"], {"OMP_NUM_THREADS": "2"})
    (t1, r1, n1, rest1), (t2, r2, n2, rest2) = (s.split(" ", 3) for s in (one, two))
    assert (t1, n1) == ("0|1", "role-a") and (t2, n2) == ("0|2", "role-b")  # exit code 0|threads
    assert r1 != r2  # numpy's global generator is seeded per process, not inherited
    assert rest1 == rest2 == "True True\n"  # its own command line (ps, /proc) and session


def test_pgrep_finds_a_forked_role_by_its_command_line(zygote: Zygote, tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    argv = [sys.executable, "-c", "import time; time.sleep(60)", "role", "trainer", "--config", str(config)]
    child = zygote.fork("trainer-0", argv, zygote.env, str(tmp_path), str(tmp_path / "t.log"))
    assert child is not None
    try:
        deadline = time.monotonic() + 20
        found: list[str] = []
        while time.monotonic() < deadline and str(child.pid) not in found:
            pgrep = ["pgrep", "-f", f"role trainer --config {config}"]
            found = subprocess.run(pgrep, capture_output=True, text=True).stdout.split()
            time.sleep(0.05)
        assert found == [str(child.pid)]
    finally:
        os.kill(child.pid, signal.SIGTERM)
    assert child.wait(20) == -signal.SIGTERM


def test_what_a_fork_cannot_honour_is_not_forked(zygote: Zygote, tmp_path: Path) -> None:
    env = {**zygote.env, "TORCH_LOGS": "+dynamo"}  # torch read it at the zygote's import
    assert zygote.fork("a", [sys.executable, "-c", "pass"], env, str(tmp_path), str(tmp_path / "a.log")) is None
    assert zygote.fork("b", ["/bin/true"], zygote.env, str(tmp_path), str(tmp_path / "b.log")) is None


LAUNCHER = """
import os, sys, time
from kubedistill.runtime.entrypoints import zygote as z
from kubedistill.runtime.entrypoints.launch import spawn

z.READY_SECONDS = float(sys.argv[1])
zygote = z.Zygote(preload=tuple(sys.argv[2:]))
sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
forked = zygote.fork("sleeper", sleep, zygote.env, os.getcwd(), os.devnull)
watch = "from kubedistill.runtime.entrypoints.zygote import end_with_launcher; end_with_launcher()"
spawned = spawn([sys.executable, "-c", watch + "; import time; time.sleep(600)"], {}, open(os.devnull, "ab"))
later = zygote.fork("later", sleep, zygote.env, os.getcwd(), os.devnull)
print(forked and forked.pid, spawned.pid, later is not None, flush=True)
sys.stdin.readline()
print(forked.wait(20), flush=True)
"""
"""A `kubedistill run` stand-in: forks a sleeper and spawns another as launch.py does, prints
their pids (and whether a second fork worked); then, told to on stdin, how the forked one ended."""


def _launcher(ready_seconds: float, *preload: str, path: str = "") -> tuple[subprocess.Popen[str], list[str]]:
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(ready_seconds), *preload],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # the fork server's traceback, where one dies importing
        text=True,
        env={**env, "PYTHONPATH": path} if path else env,
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline().split()


def _gone(*pids: int, within: float = 20.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and any(_running(p) for p in pids):
        time.sleep(0.05)
    return not any(_running(p) for p in pids)


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[1])


def test_the_roles_end_with_their_launcher_however_it_ends() -> None:
    # a process that is not (or no longer) this one's parent counts as ended: its pid may be reused
    assert _pidfd_of_parent(os.getpid()) == GONE
    launcher, said = _launcher(600)
    forked, spawned = int(said[0]), int(said[1])
    server = _parent(forked)
    assert _running(forked) and _running(spawned) and server != launcher.pid
    launcher.kill()  # as when `kubedistill run` is killed: no handler of its own runs
    launcher.wait()
    assert _gone(forked, spawned)  # each ended itself (SIGTERM)
    assert _gone(server)  # and multiprocessing's fork server, its last client gone


def test_a_forked_role_ends_with_its_fork_server() -> None:
    launcher, said = _launcher(600)
    forked, spawned = int(said[0]), int(said[1])
    os.kill(_parent(forked), signal.SIGKILL)
    assert launcher.stdout is not None and launcher.stdin is not None
    launcher.stdin.write("\n")
    launcher.stdin.flush()
    # multiprocessing can no longer say how it ended: it ends (SIGTERM) and is reported once gone
    assert launcher.stdout.readline() == "255\n" and not _running(forked)
    launcher.kill()
    launcher.wait()
    assert _gone(spawned)


def test_a_fork_server_not_ready_in_time_is_given_up_and_its_roles_spawned() -> None:
    launcher, said = _launcher(0.2, "torch")  # seconds of imports
    assert said[0] == "None" and said[2] == "False"  # not forked, then no more tries
    launcher.kill()
    launcher.wait()
    assert _gone(int(said[1]))


def test_a_fork_server_that_dies_importing_is_given_up_at_once(tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text("raise RuntimeError('not an ImportError')\n")
    started = time.monotonic()
    launcher, said = _launcher(600, "broken", path=str(tmp_path))
    assert said[0] == "None" and said[2] == "False" and time.monotonic() - started < 60
    launcher.kill()
    launcher.wait()
    assert _gone(int(said[1]))


PUBLIC_DESPITE_THE_UNDERSCORE = {"os._exit"}
"""Documented as public (the library reference's os module)."""


def _private_stdlib_names(source: str) -> list[str]:
    """`module._name` and `from module import _name` for standard-library modules in `source`."""
    tree = ast.parse(source)
    stdlib: set[str] = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            stdlib |= {(a.asname or a.name).split(".")[0] for a in node.names if _is_stdlib(a.name)}
        elif isinstance(node, ast.ImportFrom) and node.module and _is_stdlib(node.module) and not node.level:
            found += [f"{node.module}.{a.name}" for a in node.names if _private(a.name)]
            stdlib |= {a.asname or a.name for a in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            dotted = _dotted(node)
            if dotted and dotted.split(".")[0] in stdlib and dotted not in PUBLIC_DESPITE_THE_UNDERSCORE:
                found.append(dotted)
    return found


def _is_stdlib(module: str) -> bool:
    return module.split(".")[0] in sys.stdlib_module_names


def _private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return f"{inner}.{node.attr}" if inner else None
    return None


def test_the_product_uses_no_private_name_of_the_standard_library() -> None:
    """CPython's private names (threading._shutdown, atexit._run_exitfuncs, argparse's private
    classes, ...) change without notice: the product keeps to the documented API."""
    found = [
        f"{path.relative_to(ROOT)}: {name}"
        for folder in ("kubedistill", "runtime", "operator")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for name in _private_stdlib_names(path.read_text())
    ]
    assert not found, "\n".join(found)
    # the check itself finds what the zygote used to call, under any alias
    sample = "import threading, atexit as ax\nfrom sys import _getframe\nthreading._shutdown()\nax._run_exitfuncs()\n"
    assert _private_stdlib_names(sample) == ["sys._getframe", "threading._shutdown", "ax._run_exitfuncs"]
