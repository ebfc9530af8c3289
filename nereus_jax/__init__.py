"""nereus_jax: RL post-training for decoder LLMs in JAX whose parallel layout adapts while the job runs.

Public entry points: ``python -m nereus_jax.train`` (the job), and the packages ``nereus_jax.models``
(Llama/Qwen2 decoder), ``nereus_jax.sharding`` (layouts, meshes, logical-axis rules) and
``nereus_jax.config`` (the typed config tree).
"""

__version__ = "0.1.0"
