"""A fork server for `kubedistill run`'s role processes (the launcher's side and the server's).

A role process spends almost all of its start-up importing the same modules as the others:
torch, transformers' modeling stack, our engines, servers and trainer (about 9 of its 10 CPU-s
on 2 cores, 98 % of them common to the three roles). The zygote imports them once, while the
launcher reads the job, and then forks each role from that warm image: a fork takes
milliseconds, the imported pages are shared copy-on-write, and three roles on two cores no
longer each redo the same imports. A forked role then runs `python -m <module> args` as a fresh
process would: its own session, environment, working directory and log, the module run as
`__main__`, and the interpreter's exit (threads joined, atexit handlers, flushes; the modules
are not torn down).

A role forks only where a fresh process would behave the same: its environment may differ from
the zygote's only in variables that nothing preloaded reads at import (`fork_blockers`);
anything else (a user's `TORCH_LOGS` or `HF_HOME`, say) starts it as a fresh process instead.
The zygote never touches CUDA, so a forked role initializes its own GPUs.

Protocol, JSON lines on the zygote's stdin and stdout: a request {"argv", "env", "cwd", "log"}
is answered {"pid": N}; whenever a child ends the zygote says {"exit": N, "code": C} (C as
subprocess gives it: negative for a signal). The zygote ends at EOF on its stdin (the launcher
closed it, or died), and its children then get SIGTERM (PDEATHSIG).
"""

from __future__ import annotations

import atexit
import ctypes
import importlib
import json
import os
import queue
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

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
initializes CUDA, which the zygote never does)."""
FORKABLE_NAMES = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"})
THREADS_VARIABLE = "OMP_NUM_THREADS"
"""Read by OpenMP at torch's import: a forked role applies it itself (torch.set_num_threads)."""

REAP_SECONDS = 0.2
READY_SECONDS = 600.0
"""The longest a fork waits for the zygote's imports (a minute or two on a busy 2-core machine)."""


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


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL("libc.so.6", use_errno=True)


def die_with_parent() -> None:
    """Be sent SIGTERM when the process that started this one ends (PR_SET_PDEATHSIG)."""
    _libc().prctl(1, signal.SIGTERM)


# --- the launcher's side --------------------------------------------------------------------


class Forked:
    """A role forked by the zygote, polled and waited for like a subprocess.Popen."""

    def __init__(self, pid: int, zygote: Zygote) -> None:
        self.pid = pid
        self.zygote = zygote

    def poll(self) -> int | None:
        return self.zygote.exit_code(self.pid)

    def wait(self, timeout: float | None = None) -> int:
        code = self.zygote.exit_code(self.pid, wait=timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        return code


class Zygote:
    """The launcher's handle on a fork server: started at once, it imports PRELOAD in the
    background; the first fork waits for that."""

    def __init__(self, preload: Sequence[str] = PRELOAD) -> None:
        self.env = dict(os.environ)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", __name__, *preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # a role's own log shows any import error it meets
            env=self.env,
            start_new_session=True,  # the terminal's Ctrl-C goes to the launcher, which stops the roles
            preexec_fn=die_with_parent,
        )
        self._lock = threading.Lock()  # one request at a time: replies come in order
        self._pids: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._ended = threading.Condition()
        self._codes: dict[int, int] = {}
        self.gone = False
        threading.Thread(target=self._read, name="zygote-replies", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        try:
            for line in self.proc.stdout:
                reply: dict[str, Any] = json.loads(line)
                if "pid" in reply:
                    self._pids.put(int(reply["pid"]))
                else:
                    with self._ended:
                        self._codes[int(reply["exit"])] = int(reply["code"])
                        self._ended.notify_all()
        finally:
            with self._ended:
                self.gone = True
                self._ended.notify_all()
            self._pids.put(None)

    def fork(self, name: str, argv: Sequence[str], env: Mapping[str, str], cwd: str, log: str) -> Forked | None:
        """Fork `argv` (a `python -m` or `-c` command) with this environment, working
        directory and log (appended to), its process named `name` (its comm, what top and pgrep
        show); None when it cannot fork it (the caller spawns it). Waits for the zygote's
        imports, up to READY_SECONDS: a zygote not ready by then is ended, and what it would
        have forked is spawned."""
        if python_entry(argv) is None or fork_blockers(self.env, env) or self.gone:
            return None
        request = json.dumps({"name": name, "argv": list(argv), "env": dict(env), "cwd": cwd, "log": log}) + "\n"
        with self._lock:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(request.encode())
                self.proc.stdin.flush()
            except (BrokenPipeError, ValueError):  # the zygote ended (or was closed)
                return None
            try:
                pid = self._pids.get(timeout=READY_SECONDS)
            except queue.Empty:
                self.proc.kill()  # its reader then marks it gone
                return None
        return None if pid is None else Forked(pid, self)

    def exit_code(self, pid: int, wait: float | None = 0.0) -> int | None:
        """How a forked role ended, waiting up to `wait` seconds (None: until it ends); None
        while it runs."""
        deadline = None if wait is None else time.monotonic() + wait
        with self._ended:
            self._ended.wait_for(lambda: pid in self._codes or self.gone, timeout=wait)
            if pid in self._codes:
                return self._codes[pid]
            if not self.gone:
                return None
        # The zygote died first: its children were sent SIGTERM (PDEATHSIG) and someone else
        # reaps them. The best this side can say, once the process is gone, is that SIGTERM.
        while _running(pid):
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(0.05)
        return -signal.SIGTERM

    def close(self) -> None:
        """End the zygote, at once: it holds nothing to save, and may still be importing (a job
        refused after it started). Roles still running get SIGTERM (PDEATHSIG)."""
        self.proc.kill()
        self.proc.wait()
        if self.proc.stdin is not None:
            self.proc.stdin.close()


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (not gone, not a zombie left for its reaper)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


# --- the zygote's side ----------------------------------------------------------------------


def _become(request: dict[str, Any], replies: int, zygote: int) -> NoReturn:
    """In a forked child: turn into the requested role process, run it and exit as `python -m`
    would (`_exit`)."""
    die_with_parent()
    if os.getppid() != zygote:  # the zygote died before the line above: no signal will come
        os.kill(os.getpid(), signal.SIGTERM)
    os.setsid()
    _libc().prctl(15, request["name"].encode()[:15])  # PR_SET_NAME
    _show_command_line(request["argv"])
    os.chdir(request["cwd"])
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    for fd in (log, null, replies):
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    threads = os.environ.get(THREADS_VARIABLE, "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))
    if "numpy" in sys.modules:  # a fresh process seeds numpy's global generator from the OS
        sys.modules["numpy"].random.seed()
    flag, target, args = python_entry(request["argv"]) or ("", "", [])
    code = 0
    try:
        if flag == "-m":
            import runpy

            sys.argv = [target, *args]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *args]
            exec(compile(target, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as e:
        code = _exit_status(e.code)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    _exit(code)


def _exit_status(code: object) -> int:
    """The exit status `sys.exit(code)` gives, as the interpreter computes it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _exit(code: int) -> NoReturn:
    """The interpreter's exit steps that matter: non-daemon threads joined, atexit handlers run
    (logging's flush among them), stdout and stderr flushed; then out, without tearing down the
    ~3,300 modules the zygote imported, which costs a role about 2 CPU-s at the end of a job
    (a fresh role pays it too). The trainer ends its ranks the same way (roles.finish_process)."""
    threading._shutdown()  # type: ignore[attr-defined]  # what Py_FinalizeEx does first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _show_command_line(argv: Sequence[str]) -> None:
    """Write `argv` over this process's original command line, so that ps, pgrep -f and
    /proc/PID/cmdline show the role (`... role trainer --config ...`) and not the zygote. The
    kernel reads the command line from the span of memory the process was started with
    (arg_start..arg_end in /proc/self/stat); what does not fit there is cut off."""
    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    start, end = int(fields[48 - 3]), int(fields[49 - 3])  # stat fields 48 and 49, counted from 1
    text = b"\0".join(a.encode() for a in argv)[: end - start - 1]
    ctypes.memmove(start, text.ljust(end - start, b"\0"), end - start)


def _reap() -> list[tuple[int, int]]:
    ended: list[tuple[int, int]] = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return ended
        if pid == 0:
            return ended
        ended.append((pid, os.waitstatus_to_exitcode(status)))


def serve(preload: Sequence[str]) -> None:
    # Replies go out on a private copy of stdout; stdout itself becomes stderr, so that nothing
    # an import prints can garble them.
    replies = os.dup(1)
    os.dup2(2, 1)
    for name in preload:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # an optional part this build lacks: a role that needs it says so itself
    pending, zygote = b"", os.getpid()
    with selectors.DefaultSelector() as selector:
        selector.register(0, selectors.EVENT_READ)
        while True:
            for pid, code in _reap():
                os.write(replies, json.dumps({"exit": pid, "code": code}).encode() + b"\n")
            if not selector.select(REAP_SECONDS):
                continue
            chunk = os.read(0, 1 << 16)
            if not chunk:
                return  # the launcher is done (or gone): the children get SIGTERM as this exits
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    _become(request, replies, zygote)
                os.write(replies, json.dumps({"pid": pid}).encode() + b"\n")


if __name__ == "__main__":
    serve(sys.argv[1:])
