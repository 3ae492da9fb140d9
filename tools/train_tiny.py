"""Trains the tiny DeepSeek-V3 of `checkpoints/tiny-v3-code` (or the tiny DeepSeek-V4 of
`checkpoints/tiny-v4-code`), with its multi-token prediction (MTP) module, on the Python standard
library's own sources: text every machine has.

    .venv/bin/python tools/train_tiny.py                      # writes checkpoints/tiny-v3-code
    .venv/bin/python tools/train_tiny.py --arch deepseek_v4   # writes checkpoints/tiny-v4-code
    .venv/bin/python tools/train_tiny.py --files 40 --steps 2 --out /tmp/x   # a quick look

Deterministic from `--seed` on a given Python (the corpus is this interpreter's stdlib):
  1. corpus: every `*.py` under sysconfig's stdlib path (not site-packages), sorted; one file in
     20 (by a hash of its path) is held out for evaluation;
  2. tokenizer: byte-level BPE trained by `tokenizers` on the training files;
  3. model: the project's own DeepseekV3 / DeepseekV4 modules (models/), so the weights mean
     exactly what the compiler and runtime compute. A step is `--spans` spans of `--length` tokens
     of the concatenated files (packed, GPT-style), each run as one prefill of one sequence slot:
     causal attention, in the matrix products prefill compiles to;
  4. loss: next-token cross-entropy + lambda x the MTP module's, averaged over the chained
     draft depths it is trained for (DeepSeek-V3 report section 2.2; depth d joins h'_{d-1} with
     the token d ahead and predicts the one after); routers balanced without an auxiliary loss,
     by nudging each expert's selection bias against its load (the report's section 2.1.2; V4's
     hash-routed layers have none); V4's Lightning indexer gets no gradient (its top-k is a
     choice, not a product): it keeps its initial weights;
  5. output: an HF-format checkpoint in DeepSeek's names (V3's MTP module as layer
     num_hidden_layers, V4's as `mtp.0.*`), bfloat16 weights (float32 where the model keeps
     them), tokenizer.json, tokenizer_config.json (with a chat template), generation_config.json.

It prints the loss curve and, on held-out files, the main model's and the MTP module's top-1
accuracy at each draft depth.
"""

import argparse
import json
import math
import sysconfig
import time
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from deepinfer.models import ARCHS, build_model
from deepinfer.models import deepseek_v4 as v4
from deepinfer.models.state import allocate

EOS = "<|endoftext|>"
V3_CONFIG = {
    "vocab_size": 2048,
    "hidden_size": 192,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 8,
    "routed_scaling_factor": 1.0,
    "kv_lora_rank": 64,
    "q_lora_rank": 96,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "qk_nope_head_dim": 32,
    "n_group": 4,
    "topk_group": 2,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 2048,
    "num_nextn_predict_layers": 1,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "num_key_value_heads": 4,  # (MLA: every head reads the latent, as V3's release says)
}
V4_CONFIG = {
    "vocab_size": 2048,
    "hidden_size": 160,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "head_dim": 64,
    "partial_rotary_factor": 0.25,
    "q_lora_rank": 96,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "routed_scaling_factor": 1.0,
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                    "compressed_sparse_attention"],
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    "sliding_window": 64,
    "o_groups": 2,
    "o_lora_rank": 64,
    "index_n_heads": 4,
    "index_head_dim": 32,
    "index_topk": 16,
    "hc_mult": 2,
    "hc_sinkhorn_iters": 20,
    "max_position_embeddings": 2048,
    "num_nextn_predict_layers": 1,
    "rope_parameters": {"main": {"rope_type": "default", "rope_theta": 10000.0},
                        "compress": {"rope_type": "default", "rope_theta": 160000.0}},
}
ARCH_CONFIGS = {"deepseek_v3": (V3_CONFIG, "DeepseekV3ForCausalLM"), "deepseek_v4": (V4_CONFIG, "DeepseekV4ForCausalLM")}
# "# role:" headers (Python comments: the code the model knows), the request's tools as JSON lines
# first, an assistant's tool calls as <tool_call>{"name", "arguments"}</tool_call> lines (the markup
# deepinfer-serve reads back for tool_choice "auto"), and a thinking block opened when the request
# asks for `thinking` (chat_template_kwargs, or reasoning_effort).
CHAT_TEMPLATE = (
    "{% if tools %}{{ '# tools:\\n' }}{% for t in tools %}{{ t['function'] | tojson }}{{ '\\n' }}{% endfor %}{% endif %}"
    "{% for m in messages %}{{ '# ' + m['role'] + ':\\n' }}{% if m['content'] is not none %}{{ m['content'] + '\\n' }}{% endif %}"
    "{% for c in m.tool_calls or [] %}{{ '<tool_call>{\"name\": ' + c['function']['name'] | tojson + ', \"arguments\": ' "
    "+ c['function']['arguments'] + '}</tool_call>\\n' }}{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '# assistant:\\n' }}{% if thinking %}{{ '<think>\\n' }}{% endif %}{% endif %}")


def corpus() -> tuple[list[Path], list[Path]]:
    """(training files, held-out files) of this interpreter's stdlib sources."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts)
    held_out = [p for p in files if zlib.crc32(str(p.relative_to(root)).encode()) % 20 == 0]
    return [p for p in files if p not in set(held_out)], held_out


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(files: list[Path], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator((read(p) for p in files), trainer)
    return tokenizer


def token_stream(tokenizer: Tokenizer, files: list[Path]) -> torch.Tensor:
    """Every file's tokens, each followed by EOS, as one int64 tensor."""
    eos = tokenizer.token_to_id(EOS)
    ids = []
    for encoding in tokenizer.encode_batch([read(p) for p in files]):
        ids.extend(encoding.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int64)


def init_for_training(model, seed: int):
    """Small normal weights (std 0.02; output projections scaled down by depth), norms and mHC
    scales 1, selection biases, mHC bases, attention sinks and window position biases 0, hash
    routes a random permutation per token; float parameters trainable except the selection
    biases (moved by load, not gradient)."""
    generator = torch.Generator().manual_seed(seed)
    depth = 2 * (len(model.layers) + len(model.mtp))
    outputs = ("o_proj.weight", "down_proj.weight", "experts_down", "wo_b.weight", "w2.weight", "experts_w2")
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            leaf = name.rpartition(".")[2]
            if name.endswith("norm.weight") or leaf.startswith("hc_") and leaf.endswith("_scale"):
                param.fill_(1.0)
            elif name.endswith(SELECTION_BIASES) or leaf.endswith("_base") or leaf in ("attn_sink", "ape"):
                param.zero_()
            elif leaf == "tid2eid":
                experts = model.config.n_routed_experts
                param.copy_(torch.stack([torch.randperm(experts, generator=generator)[: param.shape[1]] for _ in range(param.shape[0])]))
            else:
                std = 0.02 / math.sqrt(depth) if name.endswith(outputs) else 0.02
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    for name, param in model.named_parameters():
        param.requires_grad_(param.is_floating_point() and not name.endswith(SELECTION_BIASES))
    return model


SELECTION_BIASES = ("e_score_correction_bias", "gate.bias")  # V3's router's, V4's top-k gate's


def selection_bias(module):
    """A routing module's selection bias (V3's Router, V4's top-k Gate), or None."""
    name = {"Router": "e_score_correction_bias", "Gate": "bias"}.get(type(module).__name__)
    return getattr(module, name, None) if name else None


class Model:
    """The training forward over a span of tokens, through the model's own modules (each span
    one prefill of one sequence slot, with fresh state)."""

    def __init__(self, model):
        self.m = model
        self.loads = []  # per routing call with a selection bias: (the bias, expert ids [N, k])
        for module in model.modules():
            bias = selection_bias(module)
            if bias is not None:
                module.register_forward_hook(lambda mod, args, out, bias=bias: self.loads.append((bias, out[1])))

    def forward(self, tokens: torch.Tensor, depths: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """tokens [T] -> main logits [T, V] and, per MTP depth d, logits [T, V] whose row i
        predicts t_{i+d+1} (depth d joins h'_{d-1} at i with the token d ahead)."""
        forward = v4_forward if isinstance(self.m, v4.DeepseekV4) else v3_forward
        return forward(self.m, tokens, depths)

    def balance_routers(self, rate: float):
        """Aux-loss-free balancing: each expert's selection bias moves against its load."""
        with torch.no_grad():
            for bias, ids in self.loads:
                load = torch.bincount(ids.reshape(-1), minlength=bias.numel()).float()
                bias.add_(rate * torch.sign(load.mean() - load))
        self.loads.clear()


def ahead(tokens: torch.Tensor, d: int) -> torch.Tensor:
    """The token d ahead of each row (past the end: padding)."""
    return torch.cat([tokens[d:], tokens[-1:].expand(d)])


def v3_forward(m, tokens, depths):
    T = tokens.numel()
    positions, slots, read_slot = torch.arange(T), torch.zeros(T, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)

    def pool():
        return torch.zeros(1, T, m.config.kv_cache_dim)

    h, pending, cos, sin = m.embed(tokens, positions)
    for layer in m.layers:  # (as DeepseekV3.prefill, with fresh caches)
        h, pending = layer(h, pending, cos, sin, positions, slots, read_slot, pool())
    hidden = m.head.norm(h + pending)
    logits = m.head.lm_head(hidden)
    drafts = []
    for d in range(1, depths + 1):
        h, pending = m.mtp[0].run(ahead(tokens, d), positions, hidden, slots, read_slot, pool())
        hidden = h + pending
        drafts.append(m.mtp[0].shared_head(h, pending))
    return logits, drafts


def v4_forward(m, tokens, depths):
    T = tokens.numel()
    positions, slots, read_slot = torch.arange(T), torch.zeros(T, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    state = m.new_state(1, T)
    h, post, pending, *rope, start, end = m.embed(tokens, positions, slots, torch.tensor([T - 1]))
    for layer, layer_state in zip(m.layers, state):  # (as DeepseekV4.prefill, with fresh state)
        h, post, pending = layer(h, post, pending, *rope, tokens, start, end, read_slot, *layer_state)
    logits = v4.LMHead.forward(m.head, h, post, pending)
    streams, mtp = v4.mixed_streams(h, post, pending), m.mtp[0]
    drafts = []
    for d in range(1, depths + 1):
        window = allocate(m.state_specs(1, T)[-1:])[0][0]
        streams = mtp.run(ahead(tokens, d), positions, streams, slots, T, window)
        drafts.append(mtp.logits(streams))
    return logits, drafts


def losses(logits, drafts, tokens) -> tuple[torch.Tensor, list[torch.Tensor]]:
    T = tokens.numel()
    main = F.cross_entropy(logits[:-1], tokens[1:])
    mtp = [F.cross_entropy(x[: T - d - 1], tokens[d + 1 :]) for d, x in enumerate(drafts, start=1)]
    return main, mtp


def span(stream: torch.Tensor, length: int, generator: torch.Generator) -> torch.Tensor:
    start = torch.randint(0, stream.numel() - length, (1,), generator=generator).item()
    return stream[start : start + length]


@torch.no_grad()
def evaluate(model: Model, stream: torch.Tensor, depths: int, batches: int, length: int) -> dict:
    """Held-out loss and top-1 accuracy of the main head and of each MTP depth."""
    generator = torch.Generator().manual_seed(1234)
    correct, total, loss = [0] * (depths + 1), [0] * (depths + 1), 0.0
    for _ in range(batches):
        tokens = span(stream, length, generator)
        logits, drafts = model.forward(tokens, depths)
        loss += losses(logits, drafts, tokens)[0].item() / batches
        for d, x in enumerate([logits, *drafts]):
            hit = x[: length - d - 1].argmax(-1) == tokens[d + 1 :]
            correct[d] += hit.sum().item()
            total[d] += hit.numel()
        model.loads.clear()
    return {"loss": loss, "top1": [c / t for c, t in zip(correct, total)]}


def save_checkpoint(out: Path, model, tokenizer: Tokenizer, arch: str):
    out.mkdir(parents=True, exist_ok=True)
    config, architecture = ARCH_CONFIGS[arch]
    eos = tokenizer.token_to_id(EOS)
    tensors = {}
    for name, param in model.m.named_parameters():
        keys = ARCHS[arch].checkpoint_keys(name, model.m.config, tuple(param.shape), True)
        parts = param.detach().reshape(-1, *keys[0][1]) if len(keys) > 1 else [param.detach()]
        dtype = type(model.m).param_dtype(name, torch.bfloat16)  # (float32 where the model keeps it, int64 hash routes)
        for (key, _), part in zip(keys, parts):
            tensors[key] = part.to(dtype).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf_config = {"architectures": [architecture], "model_type": arch, **config,
                 "bos_token_id": eos, "eos_token_id": eos, "torch_dtype": "bfloat16", "tie_word_embeddings": False}
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOS, "eos_token": EOS,
        "model_max_length": config["max_position_embeddings"], "chat_template": CHAT_TEMPLATE}, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": eos, "eos_token_id": eos}, indent=2) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="deepseek_v3", choices=sorted(ARCH_CONFIGS))
    parser.add_argument("--out", help="default: checkpoints/tiny-v3-code or tiny-v4-code")
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--length", type=int, default=512)  # tokens a span
    parser.add_argument("--spans", type=int, default=4)  # spans a step
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--mtp-weight", type=float, default=0.3)  # lambda
    parser.add_argument("--mtp-depths", type=int, default=2)  # chained draft depths the MTP module trains for
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--files", type=int, default=None, help="train on the first N files only (a quick look)")
    parser.add_argument("--eval-spans", type=int, default=32)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    start = time.perf_counter()

    train_files, held_out = corpus()
    train_files = train_files[: args.files]
    config = ARCH_CONFIGS[args.arch][0]
    out = Path(args.out or f"checkpoints/tiny-{args.arch.removeprefix('deepseek_')}-code")
    tokenizer = train_tokenizer(train_files, config["vocab_size"])
    train, test = token_stream(tokenizer, train_files), token_stream(tokenizer, held_out)
    print(f"corpus: {len(train_files)} files, {train.numel():,} tokens; held out {len(held_out)} files, "
          f"{test.numel():,} tokens ({time.perf_counter() - start:.0f} s)")

    net = build_model(args.arch, config=config, expert_overflow="always", draft_tokens=1)  # (builds the MTP module)
    model = Model(init_for_training(net, args.seed))
    params = [p for p in net.parameters() if p.requires_grad]
    mtp_only = sum(p.numel() for name, p in net.named_parameters() if name.startswith("mtp."))
    print(f"model: {sum(p.numel() for p in net.parameters()):,} parameters ({mtp_only:,} in the MTP module)")
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(
        math.pi * min(1.0, s / args.steps)))))
    generator = torch.Generator().manual_seed(args.seed)
    for step in range(1, args.steps + 1):
        optimizer.zero_grad(set_to_none=True)
        for _ in range(args.spans):  # (gradients accumulate: attention costs the square of a span)
            tokens = span(train, args.length, generator)
            logits, drafts = model.forward(tokens, args.mtp_depths)
            main_loss, mtp_losses = losses(logits, drafts, tokens)
            loss = main_loss + args.mtp_weight * sum(mtp_losses) / len(mtp_losses)
            (loss / args.spans).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        model.balance_routers(1e-3)
        if step % 50 == 0 or step == 1:
            print(f"step {step:5d}  loss {main_loss.item():.3f}  mtp " + " ".join(f"{x.item():.3f}" for x in mtp_losses)
                  + f"  ({time.perf_counter() - start:.0f} s)", flush=True)
    net.eval()
    result = evaluate(model, test, args.mtp_depths, args.eval_spans, args.length)
    print(f"held out: loss {result['loss']:.3f}, top-1 main {result['top1'][0]:.3f}, MTP by depth "
          + " ".join(f"{a:.3f}" for a in result["top1"][1:]))
    save_checkpoint(out, model, tokenizer, args.arch)
    print(f"wrote {out} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
