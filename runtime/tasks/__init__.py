"""Synthetic tasks for the CPU quickstart and the learning benchmark."""
