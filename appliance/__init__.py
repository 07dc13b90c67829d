"""bloom-appliance: config-free BLOOM-style 3D-parallel training with a terminal UI."""

__version__ = "0.1.0"
