"""FlashAttention-2's own test file run against flashtune.flash_attn_interface (GPU)."""
