"""The pretraining example, run from the repository root: ``python -m examples.pretrain fit --config ...``."""
