"""Command-line entry points around training: planning, benchmarks, reports, conversion, the GPU check."""
