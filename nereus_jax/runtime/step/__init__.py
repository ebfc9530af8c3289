"""One RL step: the job, its stage state (the one writer of the units), generation, scoring and training, the
plan it starts from and the one path that moves state between plans."""
