"""Weight interventions: pair extraction, QK-norm injection, merging, and pluggable mitigations."""
