"""The tiny job most runtime tests run (one copy): 1-digit addition, 16 prompts x 2 samples a step, short
sequences, actor-gen on 2 replicas. conftest's ``warm`` actor is warm-started on this shape; a test that adds
overrides after it wins (the last value of a key is the one loaded)."""

TINY_JOB = ["rollout.max_prompt_length=12", "rollout.max_response_length=8", "trainer.prompts_per_step=16",
            "rollout.samples_per_prompt=2", "trainer.actor_lr=1e-3", "trainer.critic_lr=1e-3",
            "logging.progress=false", "task.num_digits=1", "task.eval_size=16", "plan.stages.actor-gen.dp=2"]
