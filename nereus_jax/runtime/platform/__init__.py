"""The host and devices under the job: processes (jax.distributed), device memory, XLA workarounds, sharding checks."""
