"""Training data both frameworks read: token files, corpora and a BPE, the data order, packing, buckets, batch shapes."""
