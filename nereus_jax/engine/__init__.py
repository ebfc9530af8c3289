"""The JAX inference engine of actor-gen: JetStream's Engine contract (prefill / insert / generate over
decode slots), paged KV memory, sampling, and the continuous-batching driver ``generate`` the RL job calls."""

from nereus_jax.engine.contract import DecodeState, Engine, EngineError, Parked, Prefix, ResultTokens
from nereus_jax.engine.driver import Generator, Rollouts, generate
from nereus_jax.engine.engine import JaxEngine
from nereus_jax.engine.sampling import Requests, SamplingError, SamplingParams, make_requests, sample

__all__ = [
    "DecodeState",
    "Engine",
    "EngineError",
    "Generator",
    "JaxEngine",
    "Parked",
    "Prefix",
    "Requests",
    "ResultTokens",
    "Rollouts",
    "SamplingError",
    "SamplingParams",
    "generate",
    "make_requests",
    "sample",
]
