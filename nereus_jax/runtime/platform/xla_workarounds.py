"""Guards against known faults of the XLA versions we run on.

``serialize_cpu_compile_cache()``: on the CPU backend with the persistent compilation cache on
(``JAX_COMPILATION_CACHE_DIR``), jax 0.12 can crash the process (SIGSEGV in ``executable.serialize()``, writing
a cache entry) when one thread serializes an executable while another compiles: the job's engine replicas
compile their programs in threads of their own; a cache read (deserializing an executable) beside a compile has
aborted the process the same way (``get_executable_and_time``). This puts compiles, cache writes and cache
reads under one lock. Compiles on
CPU run one at a time anyway on the 2-core hosts this matters on, and with the cache off nothing changes.
"""

from __future__ import annotations

import functools
import threading

import jax

_LOCK = threading.RLock()
_installed = False


def serialize_cpu_compile_cache() -> bool:
    """Installs the lock once when the default backend is CPU and the persistent cache is on; True if installed."""
    global _installed
    if _installed:
        return True
    if jax.default_backend() != "cpu" or not jax.config.jax_compilation_cache_dir:
        return False
    from jax._src import compilation_cache, compiler  # noqa: PLC0415 - private: guarded below

    names = ("put_executable_and_time", "get_executable_and_time")
    if not (all(hasattr(compilation_cache, n) for n in names) and hasattr(compiler, "backend_compile_and_load")):
        return False
    for name in names:
        setattr(compilation_cache, name, _locked(getattr(compilation_cache, name)))
    compiler.backend_compile_and_load = _locked(compiler.backend_compile_and_load)
    _installed = True
    return True


def _locked(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with _LOCK:
            return fn(*args, **kwargs)

    return call
