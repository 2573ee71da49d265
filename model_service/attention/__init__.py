"""Attention backends over the paged KV pool: the torch reference here; GPU kernels beside it."""
