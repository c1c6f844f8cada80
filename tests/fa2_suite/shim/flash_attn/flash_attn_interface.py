"""``flash_attn.flash_attn_interface`` for FlashAttention-2's test file: flashtune's functions,
and the two module-level names the test file imports besides them."""

import torch

from flashtune.flash_attn_interface import (  # noqa: F401
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

# FlashAttention-2's ROCm/Triton switch: this is not that backend
USE_TRITON_ROCM = False


# From FlashAttention-2's flash_attn/flash_attn_interface.py at commit
# 0251105a2fb19d2957484b7f023cd8c115286ced (BSD 3-Clause: tests/fa2_suite/LICENSE.flash-attention).
# Its kernel's key-block size, read by the test file only to decode S_dmask (dropout cases,
# deselected: flashtune returns no S_dmask).
def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    # This should match the block sizes in the CUDA kernel
    assert head_dim <= 256
    major, minor = torch.cuda.get_device_capability(device)
    is_sm8x = major == 8 and minor > 0  # Only include sm86 and sm89, exclude sm80 (A100)
    is_sm80 = major == 8 and minor == 0  # noqa: F841
    is_sm90 = major == 9 and minor == 0  # noqa: F841
    if head_dim <= 32:
        return 128
    if head_dim <= 64:
        return 128 if not is_dropout else 64
    elif head_dim <= 96:
        return 64
    elif head_dim <= 128:
        if is_sm8x:
            return 64 if (not is_dropout and is_causal) else 32
        else:
            return 64 if not is_dropout else 32
    elif head_dim <= 192:
        return 64
    elif head_dim <= 224:
        return 64
    elif head_dim <= 256:
        return 64

