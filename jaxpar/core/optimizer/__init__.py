"""Optimizer rules both frameworks share: the learning-rate schedule, Muon's, 8-bit AdamW's, DiLoCo's and torchft's."""
