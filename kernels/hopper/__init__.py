"""Kernels for Hopper GPUs (compute capability 9.0), used where the plan
(:func:`..plan.plan_attention`) takes them.

The portable kernels (:mod:`..forward`, :mod:`..backward`) serve every other GPU, the CPU interpreter and CI;
both match the reference (:mod:`..reference`), which stays the oracle.
"""
