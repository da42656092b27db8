"""Requests and their KV blocks: the engine's bookkeeping, in plain Python.

Requests and sampling parameters, the step's outputs, the block pool with its prefix-cache
hashes, and the KV cache manager that hands blocks to requests. No torch, no grpc: every
other room builds on these nouns, and they are fast to test on their own.
"""
