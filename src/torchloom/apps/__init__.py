"""Applications on top of the library: the command line, training, benchmarks, data."""
