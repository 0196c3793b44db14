"""Measurements: attention-sink metrics, strict-grader evals through lm-eval, paired statistics."""
