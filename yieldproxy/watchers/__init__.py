"""Yield-state watchers: the ways the proxy learns that the GPU is taken."""
