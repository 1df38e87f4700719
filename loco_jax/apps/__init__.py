"""Applications that run the library (never imported by it): the CLI, demo, benchmarks, the
real-wire benchmark, example models and data."""
