"""Static graphs: the tracer, pattern matching and subgraph utilities (uses ``core``)."""
