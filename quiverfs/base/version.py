"""The quiverfs version (base layer: every package may import it; it imports nothing)."""

__version__ = "0.1.0"
