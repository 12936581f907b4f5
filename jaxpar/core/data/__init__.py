"""Training data both frameworks read.

Token files, corpora and a BPE, the data order, packing, buckets, batch shapes.
"""
