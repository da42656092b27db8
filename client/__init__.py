"""Async gRPC client library and the benchmark client for kvservice."""
