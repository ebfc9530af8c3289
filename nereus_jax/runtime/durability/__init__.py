"""What outlives a process: checkpoints (save, resume, integrity), Hugging Face / PEFT export, the cached warm start."""
