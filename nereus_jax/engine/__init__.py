"""The JAX inference engine of actor-gen: JetStream's Engine contract (prefill / insert / generate over
decode slots; ``generate`` is one decode step), paged KV memory, sampling, and the continuous-batching driver
(``Generator.rollouts``: one replica's responses to a batch of prompts; ``Conversations``: multi-turn
sequences whose turns wait for outside answers) the RL job calls."""

from nereus_jax.engine.contract import DecodeState, Engine, EngineError, Parked, Prefix, ResultTokens
from nereus_jax.engine.conversations import Conversations, Turn
from nereus_jax.engine.driver import Generator, Rollouts, rollouts
from nereus_jax.engine.engine import JaxEngine
from nereus_jax.engine.sampling import Requests, SamplingError, SamplingParams, make_requests, sample

__all__ = [
    "Conversations",
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
    "Turn",
    "make_requests",
    "rollouts",
    "sample",
]
