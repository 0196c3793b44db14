"""The study: its typed config, the plan of steps, the engine that keys, runs and reuses them, and the step bodies."""
