"""Kernel speed, accuracy, GPU verification and offline sm_90 compile checks."""
