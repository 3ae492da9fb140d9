"""Prompt scoring (OpenAI's `echo` with `logprobs`; what lm-eval's loglikelihood tasks send):
a prefill chunk that also returns, for every row, the log-probability of the prompt's next
token and the most likely tokens there. Done in the graph so a static-graph accelerator hands
back [T, 2 TOP + 1] numbers per chunk, not [T, V] logits."""

import torch
from torch import nn

TOP = 20  # top tokens per row (OpenAI's most); a request asking for fewer takes a prefix


class PromptScorer(nn.Module):
    def forward(self, logits, targets, last_index):
        """logits [T, V] float32 and targets [T] (row t's next prompt token; any token where none
        follows) -> one float32 vector: [T, 2 TOP + 1] scores flattened -- per row the target's
        logprob, the TOP largest logprobs, their token ids (exact in float32 below 2**24) -- then
        the logits at row last_index [V], which the first generated token is sampled from."""
        logprobs = logits.log_softmax(dim=-1)
        values, ids = logprobs.topk(TOP, dim=-1)
        scores = torch.cat([logprobs.gather(1, targets[:, None]), values, ids.float()], dim=1)
        return torch.cat([scores.flatten(), logits.index_select(0, last_index).flatten()])
