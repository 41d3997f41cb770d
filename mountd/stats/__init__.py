"""Stats: counters, the bucket cost model and the Prometheus endpoint.

Imports nothing of mountd but :mod:`mountd.errors`.
"""
