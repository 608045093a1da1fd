"""Every contract between minivllm processes: the gRPC service (serving.proto) and the ZMQ messages (wire.py)."""
