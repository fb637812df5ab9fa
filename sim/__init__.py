"""Workloads and trace loaders; the instance model, simulator and emulator come next."""
