"""The router <-> shard gRPC contract (generate.proto) and its generated stubs."""
