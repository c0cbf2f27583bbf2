"""The controller's cost and thresholds, and its runs on several GPUs."""
