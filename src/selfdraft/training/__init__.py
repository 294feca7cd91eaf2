"""Training: data (prompts, regeneration, features), masks, objectives (one strategy per method), loop."""
