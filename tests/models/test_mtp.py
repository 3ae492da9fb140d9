"""The trained tiny DeepSeek-V3 and V4 (checkpoints/tiny-v3-code, tiny-v4-code): our MTP modules'
draft logits equal an independent formula -- transformers' own decoder layer loaded with the
checkpoint's MTP block, fed DeepSeek's input (V3: h'_q = block(eh_proj([enorm(embed(t_{q+1}));
hnorm(h_q)])); V4: e_proj(enorm(embed(t_{q+1}))) + h_proj(hnorm(h_q)) over the hc streams) with h
from transformers' main model -- and the main models match transformers' logits."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer.models import build_model

transformers = pytest.importorskip("transformers")

CHECKPOINTS = Path(__file__).resolve().parents[2] / "checkpoints"
CHECKPOINT, V4_CHECKPOINT = CHECKPOINTS / "tiny-v3-code", CHECKPOINTS / "tiny-v4-code"
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"


def rms_norm(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def test_the_mtp_module_matches_an_independent_formula():
    from tokenizers import Tokenizer
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    ids = Tokenizer.from_file(str(CHECKPOINT / "tokenizer.json")).encode(PROMPT).ids
    T = len(ids)
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(CHECKPOINT, torch_dtype=torch.float32).eval()
    hf.config._attn_implementation = "eager"
    config = hf.config
    n = config.num_hidden_layers
    raw = {k: v.float() for k, v in load_file(CHECKPOINT / "model.safetensors").items()}
    mtp = {k.removeprefix(f"model.layers.{n}."): v for k, v in raw.items() if k.startswith(f"model.layers.{n}.")}

    with torch.no_grad():
        tokens = torch.tensor([ids])
        main = hf(tokens, output_hidden_states=True)
        h = main.hidden_states[-1][0]  # [T, D], after the final norm
        # Row q (0 .. T-2): the main hidden state at q and the token at q + 1, at position q.
        embedded = hf.model.embed_tokens(tokens[0, 1:])
        embedded[0] = 0.0  # (position 0, as vLLM's deepseek_mtp)
        x = torch.cat([rms_norm(embedded, mtp["enorm.weight"], config.rms_norm_eps),
                       rms_norm(h[:-1], mtp["hnorm.weight"], config.rms_norm_eps)], dim=-1) @ mtp["eh_proj.weight"].T
        block = DeepseekV3DecoderLayer(config, layer_idx=n).eval()
        weights = {k: v for k, v in mtp.items() if not k.startswith(("enorm", "hnorm", "eh_proj", "shared_head", "mlp.experts."))}
        experts = range(config.n_routed_experts)  # (transformers keeps them fused: [E, 2I, D] gate then up, [E, D, I])
        weights["mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([mtp[f"mlp.experts.{e}.gate_proj.weight"], mtp[f"mlp.experts.{e}.up_proj.weight"]]) for e in experts])
        weights["mlp.experts.down_proj"] = torch.stack([mtp[f"mlp.experts.{e}.down_proj.weight"] for e in experts])
        block.load_state_dict(weights)
        positions = torch.arange(T - 1)[None]
        causal = torch.full((T - 1, T - 1), float("-inf")).triu(1)[None, None]
        out = block(x[None], attention_mask=causal, position_ids=positions,
                    position_embeddings=hf.model.rotary_emb(x[None], positions))[0]
        expected = rms_norm(out, mtp["shared_head.norm.weight"], config.rms_norm_eps) @ mtp["shared_head.head.weight"].T

    ours = build_model(checkpoint=CHECKPOINT, dtype="float32", expert_overflow="always", draft_tokens=1)
    state = ours.new_state(1, 256)
    slot = torch.zeros(T, dtype=torch.long)
    with torch.no_grad():
        logits = ours.prefill(tokens[0], torch.arange(T), slot, slot[:1], torch.tensor([T - 1]), state)
        assert torch.allclose(logits[0], main.logits[0, -1], atol=1e-4, rtol=1e-4)
        # Draft rows over the prompt's tokens 1 .. T-1 (the MTP module at positions 0 .. T-2).
        drafts = ours.mtp[0].step(tokens[0, 1:], torch.arange(1, T), slot[1:], *state[-1])
    assert torch.allclose(drafts, expected, atol=1e-4, rtol=1e-4), (drafts - expected).abs().max()
    # A trained module: its draft agrees with the main model's own next-next token often.
    agree = (drafts.argmax(-1) == main.logits[0, 1:].argmax(-1)).float().mean()
    assert agree > 0.3, agree


def test_the_v4_mtp_module_matches_an_independent_formula(tmp_path):
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(V4_CHECKPOINT / "tokenizer.json")).encode(PROMPT).ids
    T = len(ids)
    tokens = torch.tensor([ids])
    raw = {k: v.float() if v.is_floating_point() else v for k, v in load_file(V4_CHECKPOINT / "model.safetensors").items()}
    mtp = {k.removeprefix("mtp.0."): v for k, v in raw.items() if k.startswith("mtp.0.")}
    config = json.loads((V4_CHECKPOINT / "config.json").read_text())
    eps = config.get("rms_norm_eps", 1e-6)

    # The main model's last streams h [T, n, D]: transformers' model, before its hyper-head.
    hf = transformers.AutoModelForCausalLM.from_pretrained(V4_CHECKPOINT, dtype=torch.float32).eval()
    captured = {}
    hf.model.hc_head.register_forward_pre_hook(lambda module, args: captured.update(h=args[0][0]))  # (None: args unchanged)
    with torch.no_grad():
        main = hf(tokens)
    h = captured["h"]
    x = ((rms_norm(raw["model.embed_tokens.weight"][tokens[0, 1:]], mtp["enorm.weight"], eps) @ mtp["e_proj.weight"].T)[:, None]
         + rms_norm(h[:-1], mtp["hnorm.weight"], eps) @ mtp["h_proj.weight"].T)  # [T-1, n, D], at positions 0 .. T-2

    # The block, hyper-head and norm: a one-layer transformers V4 of the MTP block's kind
    # (sliding attention, top-k MoE) holding the module's weights and the shared projection.
    own = ("e_proj.", "h_proj.", "enorm.", "hnorm.", "norm.", "hc_head_")
    block = {f"model.layers.0.{k}": v for k, v in mtp.items() if not k.startswith(own)}
    block.update({"model.embed_tokens.weight": raw["model.embed_tokens.weight"], "head.weight": raw["head.weight"],
                  "model.norm.weight": mtp["norm.weight"], "model.hc_head.hc_fn": mtp["hc_head_fn"],
                  "model.hc_head.hc_base": mtp["hc_head_base"], "model.hc_head.hc_scale": mtp["hc_head_scale"]})
    one = tmp_path / "mtp-block"
    one.mkdir()
    save_file({k: v.contiguous() for k, v in block.items()}, str(one / "model.safetensors"), metadata={"format": "pt"})
    (one / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1, "layer_types": ["sliding_attention"],
                                                  "mlp_layer_types": ["moe"]}))
    mtp_hf = transformers.AutoModelForCausalLM.from_pretrained(one, dtype=torch.float32).eval()
    mtp_hf.model.layers[0].register_forward_pre_hook(lambda module, args, kwargs: ((x[None], *args[1:]), kwargs), with_kwargs=True)
    with torch.no_grad():
        expected = mtp_hf(tokens[:, 1:]).logits[0]  # [T-1, V]

    ours = build_model("deepseek_v4", checkpoint=V4_CHECKPOINT, dtype="float32", expert_overflow="always", draft_tokens=1)
    state = ours.new_state(1, 256)
    slot = torch.zeros(T, dtype=torch.long)
    with torch.no_grad():
        logits = ours.prefill(tokens[0], torch.arange(T), slot, slot[:1], torch.tensor([T - 1]), state)
        assert torch.allclose(logits[0], main.logits[0, -1], atol=1e-4, rtol=1e-4)
        # Draft rows over the prompt's tokens 1 .. T-1 as one block (the module at positions 0 .. T-2).
        drafts = ours.mtp[0].step(tokens[0, 1:], torch.arange(1, T), slot[1:], *state[-1], T=T - 1)
    assert torch.allclose(drafts, expected, atol=1e-4, rtol=1e-4), (drafts - expected).abs().max()
    agree = (drafts.argmax(-1) == main.logits[0, 1:].argmax(-1)).float().mean()
    assert agree > 0.3, agree


@pytest.mark.parametrize("checkpoint, model_type, mtp_key", [(CHECKPOINT, "deepseek_v3", "model.layers.4.enorm.weight"),
                                                               (V4_CHECKPOINT, "deepseek_v4", "mtp.0.enorm.weight")])
def test_the_checkpoints_are_what_the_issue_asks(checkpoint, model_type, mtp_key):
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["model_type"] == model_type
    assert sum(p.stat().st_size for p in checkpoint.iterdir()) < 12 << 20
    assert mtp_key in load_file(checkpoint / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (checkpoint / name).is_file()


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v4"])
def test_the_training_script_runs_and_writes_a_checkpoint_we_load(tmp_path, arch):
    """A few steps on a few files (training for real never runs in the tests)."""
    import subprocess
    import sys

    out = tmp_path / "ckpt"
    script = Path(__file__).resolve().parents[2] / "tools" / "train_tiny.py"
    result = subprocess.run([sys.executable, str(script), "--arch", arch, "--files", "30", "--steps", "2", "--length", "64",
                             "--spans", "1", "--eval-spans", "2", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "held out: loss" in result.stdout and "MTP by depth" in result.stdout
    model = build_model(arch, checkpoint=out, expert_overflow="always", draft_tokens=1)
    assert len(model.mtp) == 1 and model.config.vocab_size == 2048
