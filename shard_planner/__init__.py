"""shard-planner: a memory and communication planner and auto-tuner for PyTorch FSDP2.

Pipeline (DESIGN.md): trace -> cost -> solve -> execute -> report. Each stage is a function over
frozen dataclasses; the CLI is a thin layer over these.
"""

__version__ = "0.1.0"
