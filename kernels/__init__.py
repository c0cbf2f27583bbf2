"""SageBwd and Attn-QAT attention kernels and their pure-PyTorch references (imported as ``sage_lightning.kernels``).

Nothing in here knows about Lightning.
"""

if __name__ != "sage_lightning.kernels":
    # This directory is installed as ``sage_lightning.kernels`` (pyproject.toml maps it). With the repository root on
    # ``sys.path`` (``python -m pytest``, a REPL started there) it is also visible as a top-level ``kernels``, the
    # import name of Hugging Face's kernel hub, which transformers imports to probe for it. Running these modules a
    # second time would register the custom ops again, and torch.library replaces a custom op by destroying the
    # first registration: every later call through sage_lightning.kernels would reach a freed operator. So the
    # top-level name is only an alias of the installed package and registers nothing.
    import importlib
    import sys

    _package = importlib.import_module("sage_lightning.kernels")
    for _name, _module in list(sys.modules.items()):
        if _name.startswith("sage_lightning.kernels."):
            sys.modules["kernels." + _name.removeprefix("sage_lightning.kernels.")] = _module
    sys.modules[__name__] = _package
else:
    from .interface import SUPPORTED_DTYPES, check_inputs, sage_attention, use_backend
    from .paths import KernelPath, kernel_path
    from .plan import KernelPlan, UnsupportedAttention, plan_attention
    from .precision import FORMATS, MODES, PRODUCTS, QAT_BACKWARDS, AttentionPrecision

    __all__ = [
        "FORMATS",
        "MODES",
        "PRODUCTS",
        "QAT_BACKWARDS",
        "SUPPORTED_DTYPES",
        "AttentionPrecision",
        "KernelPath",
        "KernelPlan",
        "UnsupportedAttention",
        "check_inputs",
        "kernel_path",
        "plan_attention",
        "sage_attention",
        "use_backend",
    ]
