"""The JAX inference engine of actor-gen: JetStream's Engine contract (prefill / insert / generate over
decode slots), sampling, and the continuous-batching driver ``generate`` the RL job calls."""

from nereus_jax.engine.driver import Generator, Rollouts, generate
from nereus_jax.engine.engine import DecodeState, Engine, EngineError, JaxEngine, Prefix, ResultTokens
from nereus_jax.engine.sampling import Requests, SamplingError, SamplingParams, make_requests, sample

__all__ = [
    "DecodeState",
    "Engine",
    "EngineError",
    "Generator",
    "JaxEngine",
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
