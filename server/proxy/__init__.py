"""The proxy (router): the client API in front of prefill and decode workers.

`server.py` is the `kvservice proxy` process; `service.py` the Generation service that pairs a
prefill and a decode worker per request and migrates streams whose decode worker is lost;
`router.py` picks the workers; `worker_pool.py` holds each role's members with their health;
`decode_stream.py` carries the requests to a decode worker on one stream (a message per step);
`discovery.py` adds and retires members found by DNS; `kv_subscriber.py` and `kv_index.py`
keep a per-worker index of cached blocks from KV events; `prompt_tokens.py` tokenizes
prompts as the workers do.
"""
