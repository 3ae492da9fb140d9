"""A decode step's attention over the KV cache in one pass: the custom op AOTInductor regions call
where compiler/backends/fused_attention.py finds that attention in a region's graph.

    torch.ops.deepinfer.latent_attention(queries, cache, slots, visible, scale, values)

queries [B, M, C] (float32 or bfloat16) are sequence b's M query rows (a decode step's heads); its
cached rows are cache[slots[b]] ([S, L, C] in the queries' dtype, the region's own cache input, read
where it lies: any strides but a unit one between a row's elements). Query row (b, m) sees row l
where visible[t, l], t = (b M + m) / (B M / T), visible [T, L] bool (a decode step's rows: its
positions so far). The result, [B, M, values] in the queries' dtype:

    softmax(scale * queries @ rows.T, masked) @ rows[..., :values]

MLA's absorbed decode attention, whose keys are the cached rows (latent and rope key) and whose
values their latent columns.

Why: as a product for the scores, a softmax and a product for the values, a decode step read each
layer's cached rows twice from memory (the step's weights evict them from the cache in between),
and all of the context bucket's rows, not the ones seen. The kernel (latent_attention.cpp) reads
each seen row once, scores it against every query and adds its latents with the running softmax's
weights while it is in L1, the rows split between the threads and merged at the end
(flash-decoding).
"""

import torch

from . import int_matmul

# Its inputs keep their strides' order, not their strides (AOTInductor's default for a custom op):
# a context bucket's cache is a view of the pool, which the kernel reads as it lies, where exact
# strides had the generated code copy every slot's rows of the bucket each step (the 190M's
# 64-position decode: 147 KB a layer; a 640-position bucket of a 4096-position pool, 1.5 MB).
torch.library.define("deepinfer::latent_attention",
                     "(Tensor queries, Tensor cache, Tensor slots, Tensor visible, float scale, int values) -> Tensor",
                     tags=(torch.Tag.needs_fixed_stride_order,))

# Its C function, as AOTInductor's generated code declares it (int_matmul.C_SHIMS's convention).
C_SHIMS = {
    "latent_attention": "AOTITorchError aoti_torch_cpu_latent_attention(AtenTensorHandle queries, AtenTensorHandle cache, "
                        "AtenTensorHandle slots, AtenTensorHandle visible, double scale, int64_t values, AtenTensorHandle* ret0)",
}


@torch.library.register_fake("deepinfer::latent_attention")
def _(queries, cache, slots, visible, scale, values):
    return queries.new_empty(*queries.shape[:2], values)


def reference(queries, cache, slots, visible, scale, values):
    """The op in torch, as models/deepseek_v3.py's MLAttention computes it: where the kernel cannot
    be built, and for tests."""
    rows = cache.index_select(0, slots)  # [B, L, C]
    T, L = visible.shape
    scores = (queries @ rows.mT * scale).view(T, -1, L).masked_fill(~visible[:, None, :], float("-inf"))
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(queries.dtype).view(queries.shape[0], -1, L)
    return probs @ rows[..., :values]


if not int_matmul.KERNEL_BUILT:
    torch.library.impl("deepinfer::latent_attention", "CPU")(reference)
