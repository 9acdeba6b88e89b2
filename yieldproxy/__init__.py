"""yieldproxy: park requests while the GPU is yielded, replay them when it returns."""

__version__ = "0.1.0"
