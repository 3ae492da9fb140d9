"""DeepSeek-V3 configuration: HF `config.json` field names, validated on the way in.

Only fields that change the math are kept; anything else in a checkpoint's config.json
(tokenizer ids aside) is ignored. A value we cannot honour raises `ConfigError` naming the key.
"""

import math
from dataclasses import dataclass, field, fields

from .config_checks import ConfigError, check_fields, check_rope, first_eos
from .moe import DEFAULT_CAPACITY
from .quantization import Fp8Blocks, QuantizationError, fp4_size_problem, parse_quantization


# Fields read or derived otherwise than by name from an HF config (rope from rope_parameters,
# quantization from quantization_config, expert_capacity and expert_overflow from the recipe).
NOT_HF_FIELDS = ("rope", "quantization", "expert_capacity", "expert_overflow", "draft_tokens")


@dataclass(frozen=True)
class RopeConfig:
    """RoPE over `qk_rope_head_dim`: the default form or YaRN, as HF `rope_parameters` write it."""

    rope_type: str = "default"  # default | yarn
    rope_theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class DeepseekV3Config:
    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    n_group: int = 8
    topk_group: int = 4
    num_experts_per_tok: int = 8
    first_k_dense_replace: int = 3
    norm_topk_prob: bool = True
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_interleave: bool = True
    attention_bias: bool = False
    num_nextn_predict_layers: int = 0  # multi-token prediction (MTP) modules, after the main layers
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1
    rope: RopeConfig = field(default_factory=RopeConfig)
    quantization: Fp8Blocks | None = None  # the checkpoint's fp8 weights (models/quantization.py)
    # Not checkpoint fields: the recipe's model.expert_capacity and expert_overflow (models/moe.py).
    expert_capacity: float = DEFAULT_CAPACITY
    expert_overflow: str = "exact"
    # The recipe's speculative.num_tokens: draft tokens a step; above 0 the MTP modules are built and read.
    draft_tokens: int = 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Width of one cached position: the compressed latent plus the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        if self.rope.rope_type == "yarn" and self.rope.mscale_all_dim:
            m = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale *= m * m
        return scale

    def tp_sharded_sizes(self) -> dict[str, int]:
        """Sizes split over tp ranks (models/parallel.py), by what to call them in an error."""
        return {"num_attention_heads": self.num_attention_heads, "intermediate_size": self.intermediate_size,
                "moe_intermediate_size x n_shared_experts": self.moe_intermediate_size * self.n_shared_experts,
                "vocab_size": self.vocab_size}

    def row_parallel_inputs(self) -> dict[str, int]:
        """Input widths of the weights split by columns over tp (o_proj, down_proj), by name."""
        return {"num_attention_heads x v_head_dim": self.num_attention_heads * self.v_head_dim,
                "intermediate_size": self.intermediate_size,
                "moe_intermediate_size x n_shared_experts": self.moe_intermediate_size * self.n_shared_experts}

    def max_len_problem(self, max_len: int, cp: int = 1) -> str | None:
        """Why kv.max_len cannot size this model's state, or None (a multiple of cp is the recipe's check)."""
        return None

    def is_moe_layer(self, index: int) -> bool:
        return index >= self.first_k_dense_replace

    def to_dict(self) -> dict:
        """HF-style dict (rope as `rope_parameters`) that `from_dict` reads back unchanged."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in NOT_HF_FIELDS}
        out["model_type"] = "deepseek_v3"
        out["rope_parameters"] = {f.name: getattr(self.rope, f.name) for f in fields(RopeConfig)}
        if self.quantization:
            out["quantization_config"] = self.quantization.to_dict()
        return out

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config", strict: bool = False) -> "DeepseekV3Config":
        """Build from an HF config.json dict. `source` names the file in error messages. `strict`
        (a recipe's inline config) refuses keys this model does not read: a typo must not
        silently become the 671B default."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: must be a mapping of HF config fields, not {type(raw).__name__}.")
        if strict:
            unknown = sorted(str(k) for k in raw if k not in _READ_KEYS)
            if unknown:
                raise ConfigError(f"{source}: unknown field(s) {unknown}; the fields read are {sorted(_READ_KEYS)}.")
        try:
            quantization = parse_quantization(raw.get("quantization_config"), source)
        except QuantizationError as err:
            raise ConfigError(str(err)) from None
        config = cls(**_checked_fields(raw, source), rope=_rope_config(raw, source), quantization=quantization)
        _check_values(config, source)
        return config


def yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _checked_fields(raw: dict, source: str) -> dict:
    model_type = raw.get("model_type", "deepseek_v3")
    if model_type != "deepseek_v3":
        raise ConfigError(
            f"{source}: model_type is {model_type!r}, but this loader reads 'deepseek_v3' only. "
            "Point model.checkpoint at a DeepSeek-V3 checkpoint, or set model.arch to match."
        )
    unsupported = {
        "hidden_act": ("silu",),
        "scoring_func": ("sigmoid",),
        "topk_method": ("noaux_tc",),
        "pretraining_tp": (1,),
    }
    for key, allowed in unsupported.items():
        if key in raw and raw[key] not in allowed:
            raise ConfigError(f"{source}: {key}={raw[key]!r} is not supported (only {allowed[0]!r}).")
    known = {f.name for f in fields(DeepseekV3Config)} - set(NOT_HF_FIELDS)
    values = {k: raw[k] for k in known if k in raw and raw[k] is not None}
    if raw.get("q_lora_rank", 0) is None:
        values["q_lora_rank"] = None  # null means a plain q projection
    values.update(first_eos(values, source))
    # num_key_value_heads is not used (MLA's kv_b_proj expands the shared latent for every head),
    # but a value that is not a head count is a broken config.
    heads = raw.get("num_key_value_heads")
    if heads is not None and (type(heads) is not int or heads < 1):
        raise ConfigError(f"{source}: num_key_value_heads={heads!r} must be a positive integer.")
    return values  # types, ranges and relations: _check_values


# Upper bounds on sizes: far above any released model, low enough that a typo (10**6 layers)
# fails here instead of hanging the build.
LIMITS = {"num_hidden_layers": 1024, "n_routed_experts": 4096, "vocab_size": 1 << 22, "num_attention_heads": 1024,
          "max_position_embeddings": 1 << 24}
SIZE_LIMIT = 1 << 20
_NON_NEGATIVE = ("n_shared_experts", "qk_nope_head_dim", "first_k_dense_replace", "num_nextn_predict_layers")
_OPTIONAL = ("q_lora_rank", "bos_token_id", "eos_token_id")  # may be null
_READ_KEYS = ({f.name for f in fields(DeepseekV3Config)} - set(NOT_HF_FIELDS)) | {
    "model_type", "rope_parameters", "rope_scaling", "rope_theta", "hidden_act", "scoring_func", "topk_method",
    "pretraining_tp", "quantization_config", "num_key_value_heads"}


def _check_values(c: DeepseekV3Config, source: str):
    """Types and ranges of every field, and the relations between them."""
    def fail(key, message):
        raise ConfigError(f"{source}: {key}={getattr(c, key, None)!r} {message}")

    check_fields(c, source, skip=NOT_HF_FIELDS, optional=_OPTIONAL, non_negative=_NON_NEGATIVE + _OPTIONAL, limits=LIMITS,
                 size_limit=SIZE_LIMIT)
    if c.qk_rope_head_dim % 2:
        fail("qk_rope_head_dim", "must be even (RoPE rotates pairs of channels).")
    if fp4_size_problem(c):
        fail(*fp4_size_problem(c))
    if c.quantization and c.attention_bias:
        fail("attention_bias", "with fp8 weights (quantization_config) is not supported; DeepSeek's release has no attention bias.")
    if c.n_routed_experts % c.n_group:
        fail("n_routed_experts", f"is not divisible by n_group={c.n_group}.")
    if c.topk_group > c.n_group:
        fail("topk_group", f"exceeds n_group={c.n_group}.")
    if c.num_experts_per_tok > c.n_routed_experts // c.n_group * c.topk_group:
        fail("num_experts_per_tok", f"is more than the {c.n_routed_experts // c.n_group * c.topk_group} experts in "
             f"topk_group={c.topk_group} of n_group={c.n_group} groups.")
    check_rope(c.rope, source)


def _rope_config(raw: dict, source: str) -> RopeConfig:
    # New HF configs write `rope_parameters`; real DeepSeek checkpoints write `rope_scaling` + `rope_theta`.
    key = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"
    params = raw.get(key) or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{source}: {key} must be a mapping (rope_type, rope_theta, factor, ...), not {type(params).__name__}.")
    params = dict(params)
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise ConfigError(f"{source}: {key}.rope_type={rope_type!r} is not supported (default or yarn).")
    params.setdefault("rope_theta", raw.get("rope_theta", RopeConfig.rope_theta))
    params.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings", 4096))
    if params.get("factor") is None:
        try:
            params["factor"] = raw.get("max_position_embeddings", 4096) / params["original_max_position_embeddings"]
        except (TypeError, ZeroDivisionError):
            raise ConfigError(f"{source}: {key}.original_max_position_embeddings and max_position_embeddings must be "
                              "positive integers.") from None
    known = {f.name for f in fields(RopeConfig)}
    unknown = sorted(str(k) for k in set(params) - known - {"partial_rotary_factor"})
    if unknown:
        raise ConfigError(f"{source}: {key} has unknown field(s) {unknown}.")
    if params.pop("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"{source}: {key}.partial_rotary_factor other than 1.0 is not supported.")
    for name in [n for n, v in params.items() if v is None and n != "attention_factor"]:
        params.pop(name)  # HF treats a null as the default
    return RopeConfig(rope_type=rope_type, **params)


# The built-in tiny model for the demo and tests: 1 dense + 2 MoE layers, 8 experts in 4 groups.
TINY_CONFIG = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 8,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "qk_nope_head_dim": 16,
    "n_group": 4,
    "topk_group": 2,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 256,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
}
