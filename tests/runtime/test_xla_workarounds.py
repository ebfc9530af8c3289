"""With the persistent compilation cache on (the test session sets one), a Job puts XLA compiles and cache
writes under one lock: concurrent compiles from threads (engine replicas, the compile-ahead thread) give the
values a single thread computes."""

import threading

import jax
import jax.numpy as jnp

from nereus_jax.runtime.platform.xla_workarounds import serialize_cpu_compile_cache


def test_compiles_from_threads_under_the_lock_compute_what_one_thread_computes():
    assert jax.config.jax_compilation_cache_dir  # tests/conftest.py turns the cache on
    assert serialize_cpu_compile_cache() and serialize_cpu_compile_cache()  # installed once, idempotent
    from jax._src import compilation_cache, compiler

    assert hasattr(compiler.backend_compile_and_load, "__wrapped__")
    assert hasattr(compilation_cache.put_executable_and_time, "__wrapped__")
    assert hasattr(compilation_cache.get_executable_and_time, "__wrapped__")

    def program(i):
        return jax.jit(lambda x: jnp.sin(x) * (i + 0.5) + jnp.cos(x * i) ** 2)

    expected = {i: float(program(i)(jnp.float32(i))) for i in range(6)}
    jax.clear_caches()
    got = {}
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, float(program(i)(jnp.float32(i)))))
               for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == expected
