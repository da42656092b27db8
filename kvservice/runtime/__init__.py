"""What every process shares: engine and routing flags, TLS, the process environment,
the event loop, and the wire's finish reasons. Servers, client and benchmarks all read these."""
