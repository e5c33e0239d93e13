"""Turning target logits into tokens: the plain sampler here, the rejection sampler with speculation."""
