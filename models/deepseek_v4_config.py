"""DeepSeek-V4 configuration: HF `config.json` field names (transformers' DeepseekV4Config),
validated on the way in. Legacy fields (`compress_ratios`, `num_hash_layers`,
`qk_rope_head_dim`, `compress_rate_csa/hca`) fold in as transformers folds them.
"""

import math
from dataclasses import dataclass, field, fields

from .config_checks import ConfigError, check_fields, check_rope, first_eos
from .deepseek_v3_config import RopeConfig
from .moe import DEFAULT_CAPACITY
from .quantization import Fp8Blocks, QuantizationError, fp4_size_problem, parse_quantization

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
ATTENTION_TYPES = (SLIDING, CSA, HCA)
MLP_TYPES = ("hash_moe", "moe")
_LEGACY_RATIO = {0: SLIDING, 4: CSA, 128: HCA}
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid")


# Fields read or derived otherwise than by name from an HF config (the ropes from rope_parameters,
# quantization from quantization_config, expert_capacity and expert_overflow from the recipe).
NOT_HF_FIELDS = ("rope", "compress_rope", "quantization", "expert_capacity", "expert_overflow", "draft_tokens")


@dataclass(frozen=True)
class DeepseekV4Config:
    vocab_size: int = 129280
    hidden_size: int = 4096
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64  # head_dim * partial_rotary_factor: the rotated LAST channels of a head
    q_lora_rank: int = 1024
    num_experts_per_tok: int = 6
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True  # read, not used: V4 always normalises the picked scores (transformers, DeepSeek)
    routed_scaling_factor: float = 1.5
    max_position_embeddings: int = 1048576
    layer_types: tuple = ()
    mlp_layer_types: tuple = ()
    compress_rate_csa: int = 4  # m
    compress_rate_hca: int = 128  # m'
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    rms_norm_eps: float = 1e-6
    num_nextn_predict_layers: int = 1  # multi-token prediction (MTP) modules, DeepSeek's `mtp.*` (transformers' default)
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1
    rope: RopeConfig = field(default_factory=RopeConfig)  # "main": sliding layers
    compress_rope: RopeConfig = field(default_factory=lambda: RopeConfig(rope_theta=160000.0, attention_factor=1.0))
    quantization: Fp8Blocks | None = None  # the checkpoint's fp8 / fp4 weights (models/quantization.py)
    expert_capacity: float = DEFAULT_CAPACITY  # not a checkpoint field: the recipe's model.expert_capacity (models/moe.py)
    expert_overflow: str = "exact"  # nor this: the recipe's model.expert_overflow (models/moe.py)
    draft_tokens: int = 0  # nor this: the recipe's speculative.num_tokens; above 0 the MTP modules are built and read


    def compress_rate(self, attention_type: str) -> int:
        """Positions pooled into one compressed entry (0: the layer keeps none)."""
        return {SLIDING: 0, CSA: self.compress_rate_csa, HCA: self.compress_rate_hca}[attention_type]

    def max_len_problem(self, max_len: int, cp: int = 1) -> str | None:
        """Why kv.max_len cannot size this model's state, or None: the compressed entries are
        max_len / rate per layer (striped over a context-parallel group of cp ranks), so it must be
        a multiple of every compress rate in use, times cp."""
        rates = sorted({self.compress_rate(t) for t in self.layer_types} - {0})
        bad = [r for r in rates if max_len % (r * cp)]
        if bad:
            step = math.lcm(*rates) * cp
            times = f" times parallel.cp={cp}" if cp > 1 else ""
            return (f"{max_len} must be a multiple of every compress rate the layers use ({rates}){times}: the compressed "
                    f"state holds max_len / rate entries{' over the cp group' if cp > 1 else ''}. Use a multiple of {step}, "
                    f"e.g. {max(step, max_len // step * step)}.")
        return None

    def tp_sharded_sizes(self) -> dict[str, int]:
        """Sizes split over tp ranks: the query heads in whole output groups, the shared expert
        and the LM head."""
        return {"num_attention_heads": self.num_attention_heads, "o_groups": self.o_groups,
                "moe_intermediate_size": self.moe_intermediate_size, "vocab_size": self.vocab_size}

    def row_parallel_inputs(self) -> dict[str, int]:
        """Input widths of the weights split by columns over tp: the shared expert's w2, and
        wo_b (o_groups x o_lora_rank)."""
        return {"moe_intermediate_size": self.moe_intermediate_size, "o_groups x o_lora_rank": self.o_groups * self.o_lora_rank}

    def to_dict(self) -> dict:
        """HF-style dict that `from_dict` reads back unchanged."""
        out = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name not in (*NOT_HF_FIELDS, "qk_rope_head_dim")}
        out.update(model_type="deepseek_v4", layer_types=list(self.layer_types), mlp_layer_types=list(self.mlp_layer_types),
                   partial_rotary_factor=self.qk_rope_head_dim / self.head_dim, rope_theta=self.rope.rope_theta,
                   compress_rope_theta=self.compress_rope.rope_theta)
        for key in ("compress_rate_csa", "compress_rate_hca"):
            out.pop(key)
        out["compress_rates"] = {CSA: self.compress_rate_csa, HCA: self.compress_rate_hca}
        out["rope_parameters"] = {"main": _rope_dict(self.rope), "compress": _rope_dict(self.compress_rope)}
        if self.quantization:
            out["quantization_config"] = self.quantization.to_dict()
        return out

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config", strict: bool = False) -> "DeepseekV4Config":
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: must be a mapping of HF config fields, not {type(raw).__name__}.")
        if strict:
            unknown = sorted(str(k) for k in raw if k not in _READ_KEYS)
            if unknown:
                raise ConfigError(f"{source}: unknown field(s) {unknown}; the fields read are {sorted(_READ_KEYS)}.")
        if raw.get("model_type", "deepseek_v4") != "deepseek_v4":
            raise ConfigError(f"{source}: model_type is {raw['model_type']!r}, but model.arch deepseek_v4 reads 'deepseek_v4' "
                              "checkpoints only. Set model.arch to match the checkpoint.")
        quantization_config = raw.get("quantization_config")
        if isinstance(quantization_config, dict) and "expert_dtype" in raw and "expert_dtype" not in quantization_config:
            quantization_config = {**quantization_config, "expert_dtype": raw["expert_dtype"]}  # V4's place for it
        try:
            quantization = parse_quantization(quantization_config, source)
        except QuantizationError as err:
            raise ConfigError(str(err)) from None
        for key, allowed in {"hidden_act": ("silu",), "num_key_value_heads": (1,), "attention_bias": (False,),
                             "mlp_bias": (False,)}.items():
            if key in raw and raw[key] not in allowed:
                raise ConfigError(f"{source}: {key}={raw[key]!r} is not supported (only {allowed[0]!r}).")
        known = {f.name for f in fields(cls)} - {*NOT_HF_FIELDS, "layer_types", "mlp_layer_types"}
        values = {k: raw[k] for k in known if raw.get(k) is not None}
        values.update(first_eos(values, source))
        if raw.get("eos_token_id", 1) is None:
            values["eos_token_id"] = None
        _fold_legacy(raw, values, source)
        config = cls(**values, rope=_main_rope(raw, source), compress_rope=_compress_rope(raw, source), quantization=quantization)
        _check_values(config, source)
        return config


def layer_kind(attention_type: str, mlp_type: str) -> str:
    """What the compiler traces once: attention type x MLP type, e.g. 'csa.moe'."""
    return f"{ {SLIDING: 'sliding', CSA: 'csa', HCA: 'hca'}[attention_type]}.{mlp_type}"


def _fold_legacy(raw: dict, values: dict, source: str):
    """layer_types / mlp_layer_types / compress rates / rope dims, from current or legacy fields."""
    n = values.get("num_hidden_layers", DeepseekV4Config.num_hidden_layers)
    if not isinstance(n, int) or isinstance(n, bool) or not 0 < n <= 1024:
        raise ConfigError(f"{source}: num_hidden_layers={n!r} must be an integer in [1, 1024].")
    rates = raw.get("compress_rates") or {}
    if not isinstance(rates, dict) or set(rates) - {CSA, HCA}:
        raise ConfigError(f"{source}: compress_rates must be a mapping {{{CSA!r} or {HCA!r}: rate}}, not {rates!r}.")
    for key, name in ((CSA, "compress_rate_csa"), (HCA, "compress_rate_hca")):
        if key in rates:
            values[name] = rates[key]
    # Legacy fields are checked even where newer ones override them: a wrong value is a wrong config.
    ratios = raw.get("compress_ratios")
    if ratios is not None:
        # DeepSeek's own config lists one more ratio than layers: its MTP layer's (not a main layer).
        if (not isinstance(ratios, list) or len(ratios) not in (n, n + 1)
                or not all(type(r) is int and r in _LEGACY_RATIO for r in ratios)):
            raise ConfigError(f"{source}: compress_ratios={ratios!r} must list a legacy ratio, 0 (sliding), 4 (CSA) or "
                              f"128 (HCA), for each of the num_hidden_layers={n} layers (and one for the MTP layer).")
    n_hash = raw.get("num_hash_layers")
    n_hash = 3 if n_hash is None else n_hash  # transformers' default
    if type(n_hash) is not int or not 0 <= n_hash <= n:
        raise ConfigError(f"{source}: num_hash_layers={n_hash!r} must be an integer in [0, num_hidden_layers={n}].")
    layer_types = raw.get("layer_types")
    if layer_types is None and ratios is not None:
        layer_types = [_LEGACY_RATIO[r] for r in ratios[:n]]
    if layer_types is None:  # transformers' default: 2 HCA, then CSA / HCA interleaved
        layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    mlp_types = raw.get("mlp_layer_types")
    if mlp_types is None:
        mlp_types = ["hash_moe"] * n_hash + ["moe"] * (n - n_hash)
    for key, types, allowed in (("layer_types", layer_types, ATTENTION_TYPES), ("mlp_layer_types", mlp_types, MLP_TYPES)):
        if not isinstance(types, list) or len(types) != n or any(not isinstance(t, str) or t not in allowed for t in types):
            raise ConfigError(f"{source}: {key} must list one of {allowed} for each of the num_hidden_layers={n} layers, "
                              f"no more and no fewer; got {types!r}.")
    values["layer_types"], values["mlp_layer_types"] = tuple(layer_types), tuple(mlp_types)
    head_dim = values.get("head_dim", DeepseekV4Config.head_dim)
    factor = raw.get("partial_rotary_factor")
    if factor is None and raw.get("qk_rope_head_dim") is not None:
        values["qk_rope_head_dim"] = raw["qk_rope_head_dim"]
    elif factor is not None:
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not 0 < factor <= 1:
            raise ConfigError(f"{source}: partial_rotary_factor={factor!r} must be in (0, 1].")
        values["qk_rope_head_dim"] = int(head_dim * factor) if isinstance(head_dim, int) else 0


def _main_rope(raw: dict, source: str) -> RopeConfig:
    """The sliding layers' rope: default (unscaled) over `rope_theta`, as transformers builds it."""
    params = raw.get("rope_parameters")
    main = params.get("main") if isinstance(params, dict) else None
    known = {f.name for f in fields(RopeConfig)} | {"partial_rotary_factor"}
    if main is not None and (not isinstance(main, dict) or set(main) - known):
        raise ConfigError(f"{source}: rope_parameters.main={main!r} must be a mapping of RoPE fields ({sorted(known)}); "
                          "the sliding layers use its rope_type (default) and rope_theta.")
    if isinstance(main, dict):
        if main.get("rope_type", "default") != "default":
            raise ConfigError(f"{source}: rope_parameters.main.rope_type={main['rope_type']!r} is not supported (default).")
        return RopeConfig(rope_theta=main.get("rope_theta", raw.get("rope_theta", 10000.0)))
    return RopeConfig(rope_theta=raw.get("rope_theta", 10000.0))


def _compress_rope(raw: dict, source: str) -> RopeConfig:
    """The compressed branches' rope: `rope_parameters.compress` (nested), else a flat YaRN dict
    (`rope_parameters` / `rope_scaling`) over `compress_rope_theta`. YaRN's attention factor is
    1 unless given (DeepSeek's code does not scale cos/sin)."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{source}: rope_parameters must be a mapping, not {type(params).__name__}.")
    compress = params.get("compress")
    if compress is not None and not isinstance(compress, dict):
        raise ConfigError(f"{source}: rope_parameters.compress must be a mapping, not {compress!r}.")
    params = dict(compress or {k: v for k, v in params.items() if k != "main"})
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise ConfigError(f"{source}: rope_parameters.compress.rope_type={rope_type!r} is not supported (default or yarn).")
    params.pop("partial_rotary_factor", None)
    params.setdefault("rope_theta", raw.get("compress_rope_theta", 160000.0))
    params.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings", 1048576))
    if rope_type == "yarn" and params.get("attention_factor") is None:
        params["attention_factor"] = 1.0
    if params.get("factor") is None:
        params["factor"] = 1.0
    params = {k: v for k, v in params.items() if v is not None}
    unknown = sorted(set(params) - {f.name for f in fields(RopeConfig)})
    if unknown:
        raise ConfigError(f"{source}: rope_parameters.compress has unknown field(s) {unknown}.")
    return RopeConfig(rope_type=rope_type, **params)


def _rope_dict(rope: RopeConfig) -> dict:
    return {f.name: getattr(rope, f.name) for f in fields(RopeConfig)}


LIMITS = {"num_hidden_layers": 1024, "n_routed_experts": 4096, "vocab_size": 1 << 22, "num_attention_heads": 1024,
          "max_position_embeddings": 1 << 24, "hc_mult": 16, "hc_sinkhorn_iters": 100,
          "num_nextn_predict_layers": 16}
_READ_KEYS = ({f.name for f in fields(DeepseekV4Config)} - set(NOT_HF_FIELDS)) | {
    "model_type", "rope_parameters", "rope_scaling", "rope_theta", "compress_rope_theta", "compress_rates",
    "compress_ratios", "num_hash_layers", "partial_rotary_factor", "hidden_act", "num_key_value_heads",
    "attention_bias", "mlp_bias", "quantization_config", "expert_dtype"}


def _check_values(c: DeepseekV4Config, source: str):
    """Types and ranges of every field, and the relations the static graphs rely on."""
    def fail(key, message):
        raise ConfigError(f"{source}: {key}={getattr(c, key, None)!r} {message}")

    if fp4_size_problem(c):
        fail(*fp4_size_problem(c))
    check_fields(c, source, skip=(*NOT_HF_FIELDS, "layer_types", "mlp_layer_types"),
                 optional=("bos_token_id", "eos_token_id"), non_negative=("bos_token_id", "eos_token_id", "num_nextn_predict_layers"),
                 limits=LIMITS)
    if c.scoring_func not in SCORING_FUNCS:
        fail("scoring_func", f"is not supported (one of {SCORING_FUNCS}).")
    if c.n_shared_experts != 1:
        fail("n_shared_experts", "is not supported: DeepSeek-V4 has one shared expert of moe_intermediate_size.")
    if c.qk_rope_head_dim % 2 or not 0 < c.qk_rope_head_dim <= min(c.head_dim, c.index_head_dim):
        fail("qk_rope_head_dim", f"(head_dim x partial_rotary_factor) must be even and at most head_dim={c.head_dim} "
             f"and index_head_dim={c.index_head_dim}.")
    if c.num_attention_heads % c.o_groups:
        fail("o_groups", f"must divide num_attention_heads={c.num_attention_heads}.")
    if c.num_experts_per_tok > c.n_routed_experts:
        fail("num_experts_per_tok", f"is more than n_routed_experts={c.n_routed_experts}.")
    check_rope(c.rope, source, "rope_parameters.main")
    check_rope(c.compress_rope, source, "rope_parameters.compress")


# The built-in tiny V4 for the demo and tests: every attention type and both MLP types, 4 kinds.
TINY_V4_CONFIG = {
    "vocab_size": 320,
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "head_dim": 32,
    "partial_rotary_factor": 0.25,
    "q_lora_rank": 48,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "layer_types": [SLIDING, CSA, HCA, CSA],
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
    "compress_rates": {CSA: 4, HCA: 16},
    "sliding_window": 16,
    "o_groups": 2,
    "o_lora_rank": 16,
    "index_n_heads": 8,
    "index_head_dim": 16,
    "index_topk": 4,
    "hc_mult": 2,
    "hc_sinkhorn_iters": 20,
    "max_position_embeddings": 256,
    "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                        "beta_fast": 32, "beta_slow": 1},
}
