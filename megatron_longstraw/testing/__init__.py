"""Helpers shared by the test suite and the GPU test runner (reference models, launchers)."""
