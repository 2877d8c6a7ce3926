"""A damaged cache and killed builds (issue 42): what is left behind must never break the next start."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from speculate.models import kernel

LOAD_KERNELS = "from speculate.models import kernel; import sys; sys.exit(0 if kernel.load() is not None else 3)"


def run_python(code: str, cache, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "SPECULATE_CACHE": str(cache), **env})


@pytest.mark.skipif(kernel._compiler() is None, reason="no C compiler")
def test_a_damaged_kernel_library_is_rebuilt_not_loaded(tmp_path):
    """A truncated .so was mapped and every later start died of SIGBUS with no message (a zeroed page: SIGSEGV);
    now the library's recorded sha256 is checked before loading, and a mismatch is rebuilt. A missing record (a
    build killed between its two writes) is rebuilt quietly."""
    first = run_python(LOAD_KERNELS, tmp_path)
    assert first.returncode == 0, first.stderr
    (built,) = (tmp_path / "kernels").glob("kernels-*.so")
    size = built.stat().st_size
    for damage in ("truncated", "zeroed", "no record"):
        if damage == "truncated":
            os.truncate(built, size // 3)
        elif damage == "zeroed":
            built.write_bytes(bytes(size))
        else:
            built.with_suffix(".sha256").unlink()
        again = run_python(LOAD_KERNELS, tmp_path)
        assert again.returncode == 0, (damage, again.returncode, again.stderr[-2000:])
        assert built.stat().st_size == size, damage
        assert built.with_suffix(".sha256").read_text() == kernel.sha256_file(built), damage
        assert ("do not match their recorded checksum" in again.stderr) == (damage != "no record"), damage
