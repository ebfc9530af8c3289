"""The job runtime: owns the model-stage state, runs steps, applies transitions at step boundaries."""
