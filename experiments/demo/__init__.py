"""The embedded miniature study: generated corpus, tiny backbones pretrained from scratch, LLaVA-style
adaptation on scikit-learn digits, and the build steps the study runner executes (see docs/study.md)."""
