"""The typed configuration: one tree of frozen dataclasses (a docstring per field) from which every
command line is generated (``config/cli.py``); imports nothing above it and no torch."""
