"""RL algorithms (advantages, losses), tasks with verifiable rewards, prompt data and tokenizers."""
