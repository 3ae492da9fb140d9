"""A gather of one row (index_select by a one-element index: one sequence's slot of a KV cache in
a prefill chunk or a batch-1 decode step, a prompt's last row) becomes a view at that row.

Why: inductor materializes an index_select that feeds a matrix product (the product is a library
call reading a buffer), so the attention of every layer copied its sequence's whole context out
of the cache before reading it: at 640 positions of the 190M bench model's float32 latents, 737 KiB
a layer and step, written and read again. As a view, the products read the cache where it lies.
The row's index is read as a number in the graph (`item`: an unbacked size, bounds-checked as the
gather was); the other backends keep the portable gather (torch-mlir lowers no view at an offset
only known at run time).

Not where a gathered tensor is stored into first and is a view with gaps (a context bucket's
cache, the first c positions of the pool's rows): around a view at a run-time offset, inductor
does not store into such an input in place but copies all of it in and out (seen in its code:
two loops over the whole cache a layer). Those regions keep the gather, which inductor fuses into
the products at small contexts anyway (the 190M's decode at 64 positions copies nothing).

Applied to the exported region before inductor traces it (`program.run_decompositions`), where a
decomposition may read a tensor's value; inductor's post-grad passes come after.
"""

import torch

aten = torch.ops.aten


def one_row_view(x, dim, index):
    """index_select(x, dim, index) for a one-element index, as x's row at index, else as it was."""
    if index.dim() != 1 or index.shape[0] != 1:
        return NotImplemented
    row = index[0].item()
    torch._check(row >= 0)
    torch._check(row < x.shape[dim])
    return x.select(dim, row).unsqueeze(dim)


def apply(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """The program with its one-row gathers as views; as it was (not traced again) without any."""
    one_row = [node for node in program.graph.nodes
               if node.target is aten.index_select.default and tuple(node.args[2].meta["val"].shape) == (1,)]
    if not one_row or any(_stored_into_with_gaps(node.args[0]) for node in one_row):
        return program
    return program.run_decompositions({aten.index_select.default: one_row_view})


def _stored_into_with_gaps(node) -> bool:
    """Whether a gathered value is a graph input with gaps, written in place first (index_put_,
    index_copy_, copy_ into it: the exported graph reads the write's result)."""
    stores = 0
    while node.op == "call_function" and _writes_first_argument(node.target):
        node, stores = node.args[0], stores + 1
    return stores > 0 and node.op == "placeholder" and not node.meta["val"].is_contiguous()


def _writes_first_argument(target) -> bool:
    arguments = target._schema.arguments if isinstance(target, torch._ops.OpOverload) else []
    return bool(arguments) and arguments[0].alias_info is not None and arguments[0].alias_info.is_write
