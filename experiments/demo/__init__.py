"""The embedded miniature study: generated corpus, tiny backbones pretrained from scratch, LLaVA-style
adaptation on scikit-learn digits, and the build steps it hands a study's plan (`build.Build`; docs/study.md)."""
