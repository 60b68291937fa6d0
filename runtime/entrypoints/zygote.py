"""A fork server for `kubedistill run`'s role processes, on the standard library's forkserver.

A role process spends almost all of its start-up importing the same modules as the others:
torch, transformers' modeling stack, our engines, servers and trainer (about 9 of its 10 CPU-s
on 2 cores, 98 % of them common to the three roles). `multiprocessing`'s forkserver imports them
once (`set_forkserver_preload`), in a fresh interpreter started while the launcher reads the job,
and forks each role from that warm image: a fork takes milliseconds, the imported pages are
shared copy-on-write, and three roles on two cores no longer each redo the same imports.

A forked role then runs `python -m <module> args` (or `-c`) as a fresh process would: its own
session, environment, working directory and log, its command line shown by `setproctitle` (so
`ps` and `pgrep -f 'role trainer'` find it), the module run as `__main__`. It ends as any
`multiprocessing` child does: its non-daemon threads joined, logging flushed, stdio flushed, then
out without tearing down the modules (atexit handlers are not run; roles register none, and the
trainer ends its ranks without them too: roles.finish_process).

A role forks only where a fresh process would behave the same: its environment may differ from
the zygote's only in variables that nothing preloaded reads at import (`fork_blockers`);
anything else (a user's `TORCH_LOGS` or `HF_HOME`, say) starts it as a fresh process instead.
The fork server never touches CUDA, so a forked role initializes its own GPUs.

A role ends (SIGTERM) when the launcher ends, however it ends, and a forked one also when its
fork server ends (`end_with_launcher`, `_become`): `multiprocessing`'s parent sentinel and a pidfd
(`os.pidfd_open`) do what PR_SET_PDEATHSIG did, with no race at start (a parent already gone is
seen at once) and not tied to the thread that started the role.

One fork server per process: multiprocessing keeps one, started by the first `Zygote`, with that
one's preload and environment; it ends with the process (once the roles it forked are gone).
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.process import BaseProcess

PRELOAD: tuple[str, ...] = (
    "torch",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.auto.modeling_auto",
    "transformers.modeling_layers",
    "torch.distributed.checkpoint.state_dict",
    "uvicorn",
    "kubedistill.runtime.engines.factory",
    "kubedistill.runtime.engines.hf",
    "kubedistill.runtime.servers.http",
    "kubedistill.runtime.servers.rollout",
    "kubedistill.runtime.servers.teacher",
    "kubedistill.runtime.entrypoints.trainer",
    "kubedistill.runtime.entrypoints.status_server",
    "kubedistill.runtime.driver.loop",
)
"""What every role of an hf-engine job imports (measured with -X importtime on the quickstart).
vLLM stays out: it is imported by its servers only, and its import may look at the GPUs."""

FORKABLE_PREFIXES = ("KUBEDISTILL_", "VLLM_", "NCCL_", "GLOO_", "CUDA_")
"""Variables read when used, never at import by what PRELOAD holds: ours, vLLM's (not
preloaded), NCCL's and gloo's (read when a process group forms), CUDA's (read when a process
initializes CUDA, which the fork server never does)."""
FORKABLE_NAMES = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"})
THREADS_VARIABLE = "OMP_NUM_THREADS"
"""Read by OpenMP at torch's import: a forked role applies it itself (torch.set_num_threads)."""
LAUNCHER_VARIABLE = "KUBEDISTILL_LAUNCHER_PID"
"""Set by the launcher on a role it spawns: the process whose end ends the role (end_with_launcher)."""

READY_SECONDS = 600.0
"""The longest a fork waits for the fork server's imports (a minute or two on a busy 2-core machine)."""


def fork_blockers(zygote_env: Mapping[str, str], env: Mapping[str, str]) -> list[str]:
    """The variables, set, changed or removed in `env` against the zygote's, that a forked role
    could not honour (the preloaded modules may have read them at import); empty: it may fork."""
    changed = {k for k in set(zygote_env) | set(env) if zygote_env.get(k) != env.get(k)}
    return sorted(
        k for k in changed if k != THREADS_VARIABLE and k not in FORKABLE_NAMES and not k.startswith(FORKABLE_PREFIXES)
    )


def forks_roles(launcher: str, gpu_ids: Sequence[str]) -> bool:
    """Whether `kubedistill run` forks its roles from a zygote: plain processes on a machine
    without GPUs. With GPUs they start fresh: a fork is safe only while nothing in the zygote has
    touched the CUDA driver, which no GPU session has checked yet (bench/gpu_check.sh's `fork`
    part does), and there start-up is model loading and vLLM's engine start anyway."""
    return launcher == "processes" and not gpu_ids


def python_entry(argv: Sequence[str]) -> tuple[str, str, list[str]] | None:
    """("-m", module, args) or ("-c", code, args) for `python -m module ...` or
    `python -c code ...` run by this interpreter; None for any other command (it is spawned)."""
    if len(argv) >= 3 and argv[0] == sys.executable and argv[1] in ("-m", "-c"):
        return argv[1], argv[2], list(argv[3:])
    return None


# --- a role's end with its launcher ---------------------------------------------------------


GONE = -1
"""In place of a handle to watch: the process has ended already."""


def _pidfd_of_parent(pid: int) -> int | None:
    """A pidfd (readable once the process ends) of `pid`, this process's parent; GONE when it has
    ended already (this process was handed to another parent, and `pid` may be reused); None
    where the kernel has no pidfds (before Linux 5.3): nothing to watch."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return GONE
    except OSError:
        return None
    if os.getppid() != pid:
        os.close(fd)
        return GONE
    return fd


def _end_when_any_ends(handles: Sequence[int | None]) -> None:
    """SIGTERM this process (as the kernel's parent-death signal would) once any of `handles`
    is ready (a pidfd of a process that ended, a pipe whose writer is gone); at once for GONE."""
    if GONE in handles:
        os.kill(os.getpid(), signal.SIGTERM)
        return
    ready = [h for h in handles if h is not None]
    if not ready:
        return

    def watch() -> None:
        multiprocessing.connection.wait(ready)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="end-with-launcher", daemon=True).start()


def end_with_launcher() -> None:
    """In a role that `kubedistill run` spawned (LAUNCHER_VARIABLE set): be sent SIGTERM when
    the launcher ends. Elsewhere (a pod, a forked role, which `_become` set up) it does nothing.
    The variable is removed, so that what this role starts does not watch the launcher too."""
    pid = os.environ.pop(LAUNCHER_VARIABLE, "")
    if pid.isdigit():
        _end_when_any_ends([_pidfd_of_parent(int(pid))])


# --- the launcher's side --------------------------------------------------------------------


class Forked:
    """A role forked by the fork server, polled and waited for like a subprocess.Popen."""

    def __init__(self, process: BaseProcess) -> None:
        self.process = process
        self.pid: int = process.pid or 0
        self.code: int | None = None

    def poll(self) -> int | None:
        if self.code is None:
            code = self.process.exitcode
            # 255 is also what multiprocessing says for a role whose fork server died (it cannot
            # know more): such a role still runs until it sees that and ends.
            if code is None or (code == 255 and _running(self.pid)):
                return None
            self.code = code
            self.process.close()  # its pipes
        return self.code

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            if self.process.exitcode is None:
                self.process.join(left)
            else:  # its fork server died (above): wait for the role itself
                time.sleep(0.05 if left is None else min(0.05, left))
        return code


_server_env: dict[str, str] | None = None
"""The environment this process's fork server was started with (the first Zygote's)."""


@dataclass
class Request:
    """What a forked child is to become."""

    name: str
    argv: list[str]
    env: dict[str, str]
    cwd: str
    log: str


class Zygote:
    """A handle on this process's fork server: the first one starts it at once, importing
    `preload` in the background (the first fork waits for that); each handle ends what it forked
    when closed."""

    def __init__(self, preload: Sequence[str] = PRELOAD) -> None:
        global _server_env
        self.context = multiprocessing.get_context("forkserver")
        if _server_env is None:
            _server_env = dict(os.environ)
            # The launcher's main module too (as multiprocessing does by default): a child would
            # otherwise import it again.
            self.context.set_forkserver_preload(["__main__", __name__, "setproctitle", *preload])
        self.env = _server_env
        self.forked: list[Forked] = []
        self.gone = False
        self._lock = threading.Lock()
        self._ready = threading.Event()
        threading.Thread(target=self._wait_ready, name="zygote-ready", daemon=True).start()

    def _wait_ready(self) -> None:
        """Fork a child that does nothing: done once the fork server's imports are. The first
        one starts the fork server (multiprocessing starts it on the first fork)."""
        try:
            probe = self.context.Process(target=_nothing, name="zygote-ready")
            with self._lock:
                probe.start()
            probe.join()
            probe.close()
        except (OSError, EOFError):  # it could not start, or died importing: roles are spawned
            self.gone = True
        finally:
            self._ready.set()

    def fork(self, name: str, argv: Sequence[str], env: Mapping[str, str], cwd: str, log: str) -> Forked | None:
        """Fork `argv` (a `python -m` or `-c` command) with this environment, working
        directory and log (appended to), its process named `name` (its comm, what top shows);
        None when it cannot fork it (the caller spawns it). Waits for the fork server's imports,
        up to READY_SECONDS: a fork server not ready by then is given up, and what it would have
        forked is spawned."""
        if python_entry(argv) is None or fork_blockers(self.env, env) or self.gone:
            return None
        if not self._ready.wait(READY_SECONDS):
            self.gone = True
        if self.gone:
            return None
        request = Request(name, list(argv), dict(env), cwd, log)
        process = self.context.Process(target=_become, args=(request,), name=name)
        try:
            with self._lock:
                process.start()
        except (OSError, EOFError):  # the fork server died
            self.gone = True
            return None
        child = Forked(process)
        self.forked.append(child)
        return child

    def close(self) -> None:
        """Fork nothing more, and end (SIGTERM) what this handle forked that still runs."""
        self.gone = True
        for child in self.forked:
            if child.poll() is None:
                try:
                    os.kill(child.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        self.forked = [c for c in self.forked if c.code is None]


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (not gone, not a zombie left for its reaper)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


# --- the fork server's side -----------------------------------------------------------------

_SERVER_PID = os.getpid()
"""In a forked child: the fork server's pid (this module is preloaded there)."""


def _nothing() -> None:
    """The readiness probe's child."""


def _become(request: Request) -> None:
    """In a child of the fork server: turn into the requested role process and run it; what it
    raises ends it as it would end `python -m` (multiprocessing computes the exit status)."""
    server = _SERVER_PID if _SERVER_PID != os.getpid() else os.getppid()
    launcher = multiprocessing.parent_process()
    _end_when_any_ends([_pidfd_of_parent(server), launcher.sentinel if launcher else None])
    os.setsid()
    # Before the environment changes: setproctitle finds the command line's memory through it.
    # (Imported here: the parser of every `kubedistill` command imports this module, and the
    # operator's image has no setproctitle.)
    import setproctitle

    setproctitle.setproctitle(" ".join(request.argv))
    setproctitle.setthreadtitle(request.name)  # the process's comm, what top shows
    os.chdir(request.cwd)
    log = os.open(request.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    os.environ.clear()
    os.environ.update(request.env)
    # multiprocessing made its own start method the default here: a fresh process has the
    # platform's (what torch's DataLoader or tqdm's lock use, unless told otherwise).
    multiprocessing.set_start_method(None, force=True)
    threads = os.environ.get(THREADS_VARIABLE, "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))
    if "numpy" in sys.modules:  # a fresh process seeds numpy's global generator from the OS
        sys.modules["numpy"].random.seed()
    flag, target, args = python_entry(request.argv) or ("", "", [])
    sys.path[0] = os.getcwd() if flag == "-m" else ""  # as a fresh `python -m` or `-c` has it
    try:
        if flag == "-m":
            sys.argv = [target, *args]
            sys.modules.pop(target, None)  # not imported yet, as in a fresh process (the launcher's main may have)
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *args]
            exec(compile(target, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit:
        raise
    except BaseException:
        sys.excepthook(*sys.exc_info())
        raise SystemExit(1) from None
    finally:
        _join_threads()
        logging.shutdown()


def _join_threads() -> None:
    """What the interpreter does first at exit: wait for every thread that is not a daemon."""
    while rest := [t for t in threading.enumerate() if not t.daemon and t is not threading.current_thread()]:
        for t in rest:
            t.join()
