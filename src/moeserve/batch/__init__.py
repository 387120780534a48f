"""What one forward reads: the forward batch, the KV pools, and the step geometry that every
rank derives from the same gathered token counts."""
