"""Model rules both frameworks share: parameter and FLOP counts, the experts' rules, sketches, block sparsity."""
