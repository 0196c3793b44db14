"""Composition layer: study configs, the runner, reports and the `sinkstudy` CLI."""
