"""Benchmarks behind `kvservice bench`: transfer throughput and its raw TCP baseline."""
