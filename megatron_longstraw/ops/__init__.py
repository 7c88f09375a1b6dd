"""Kernels and their pure-torch references."""
