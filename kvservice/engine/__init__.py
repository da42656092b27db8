"""The step loop and its front ends: scheduler, engine, async engine, offline `LLM`.

The scheduler plans each step (continuous batching, chunked prefill, the connector's
scheduler half); the engine runs schedule -> model runner -> update; the async engine drives
it from asyncio for the servers; `LLM` is the offline Python API. Stop strings and
detokenization live here too. Imports the connector contract, never an implementation.
"""
