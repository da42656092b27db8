"""KV connectors: the lifecycle contract and the gRPC pull connector."""
