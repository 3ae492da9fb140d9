"""The weight bytes a decode token reads on a rank: what decode speed on a CPU is bound by.

A batch-1 decode step reads every weight of the main model once, except the embedding (one row
a token) and the routed experts (the k a token routes to: of a rank's stack of E_local experts,
k / world_size on average, as a rank computes the E / world_size experts it owns). The MTP
drafter's weights are read by draft steps, not counted. The KV cache a step reads grows with the
context and is not counted either."""

import math

STACKED_EXPERTS = ".experts_"  # stacked routed-expert tensors (and their scales) of every architecture


def weight_bytes_per_token(model, specs, world_size: int) -> int:
    """`specs`: (name, shape, dtype) of a rank's stored tensors; `model`: the model (any shapes),
    for which of them are its embedding and its routing (k of n_routed_experts)."""
    embedding = {f"embed.{name}" for name, _ in model.embed.named_parameters()}
    k = model.config.num_experts_per_tok
    total = 0.0
    for name, shape, dtype in specs:
        size = math.prod(shape) * dtype.itemsize
        if name.startswith("mtp."):
            continue
        if name in embedding:
            size /= shape[0]
        elif STACKED_EXPERTS in name:
            size *= k / (shape[0] * world_size)
        total += size
    return round(total)
