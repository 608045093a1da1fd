"""The scheduler process: request queues, the global KV block table, batching, gRPC ingress. Never imports torch."""
