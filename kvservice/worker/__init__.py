"""One model step on one device: input batch, model runner, samplers, draft proposer.

The model runner turns a `SchedulerOutput` into tensors, runs the model inside the connector
lifecycle (`kvservice.connector.lifecycle`), samples, and reports a `ModelRunnerOutput`.
"""
