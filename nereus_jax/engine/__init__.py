"""The JAX inference engine of actor-gen: JetStream's Engine contract (prefill / insert / generate over
decode slots; ``generate`` is one decode step), paged KV memory, sampling, and the continuous-batching driver
(``Generator.rollouts``: one replica's responses to a batch of prompts) the RL job calls."""

from nereus_jax.engine.contract import DecodeState, Engine, EngineError, Parked, Prefix, ResultTokens
from nereus_jax.engine.driver import Generator, Rollouts, rollouts
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
    "make_requests",
    "rollouts",
    "sample",
]
