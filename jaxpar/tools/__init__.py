"""Commands around training: planning, benchmarks, HLO inspection, reports, weight conversion."""
