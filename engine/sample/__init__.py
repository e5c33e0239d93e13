"""Turning target logits into tokens: one rejection-sampling path (plain decoding is k = 0) over the
step layout's per-row sampling tensors."""
