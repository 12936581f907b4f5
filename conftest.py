"""Shared by tests/ and parity_tests/: one persistent XLA compilation cache per test session, so that the
many trainer processes compiling the same tiny programs compile each once (a fresh directory: every
session still compiles everything at least once)."""
import atexit
import os
import shutil
import tempfile

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="jaxpar-test-xla-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ.update(JAX_COMPILATION_CACHE_DIR=_cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")

# jaxpar's CLIs would re-execute themselves to set this (jaxpar/core/malloc.py); set here, every trainer process a
# test starts skips that and runs with it from the start
os.environ.setdefault("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
