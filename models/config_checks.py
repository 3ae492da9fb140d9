"""Type and range checks shared by the model configs: every field by the type of its default,
and a RoPE block. Each failure is a ConfigError naming the source and the key."""

import math
from dataclasses import fields

from deepinfer.runtime.errors import DeepinferError


class ConfigError(DeepinferError, ValueError):
    """A config value that is missing, unknown or not supported; the message names the key."""

    exit_code = 2  # bad input, as a bad recipe


def check_fields(config, source: str, skip=(), optional=(), non_negative=(), limits=None, size_limit: int = 1 << 20):
    """bools are bools; ints are integers, positive (0 or more for `non_negative`) and at most
    their limit; floats positive and finite. `optional` fields may be None."""
    def fail(key, message):
        raise ConfigError(f"{source}: {key}={getattr(config, key, None)!r} {message}")

    for f in fields(config):
        value, default = getattr(config, f.name), f.default
        if f.name in skip or (value is None and f.name in optional):
            continue
        if isinstance(default, bool):
            if not isinstance(value, bool):
                fail(f.name, "must be true or false.")
        elif isinstance(default, int) or f.name in optional:
            if not isinstance(value, int) or isinstance(value, bool):
                fail(f.name, "must be an integer.")
            if f.name in non_negative and value < 0:
                fail(f.name, "must be 0 or more.")
            if f.name not in non_negative and value <= 0:
                fail(f.name, "must be positive.")
            limit = (limits or {}).get(f.name, size_limit)
            if value > limit:
                fail(f.name, f"is past the largest supported value {limit}.")
        elif isinstance(default, float):
            if not _positive_number(value):
                fail(f.name, "must be a positive finite number.")
    for key in ("bos_token_id", "eos_token_id"):
        value = getattr(config, key, None)
        if value is not None and not (0 <= value < config.vocab_size):
            fail(key, f"must be a token id below vocab_size={config.vocab_size}.")


def first_eos(values: dict, source: str) -> dict:
    """HF configs may list several EOS ids; the engine stops at the first. Every one must be an id."""
    eos = values.get("eos_token_id")
    if not isinstance(eos, list):
        return {}
    if not eos or not all(type(t) is int for t in eos):
        raise ConfigError(f"{source}: eos_token_id={eos!r} must be a token id or a non-empty list of them.")
    return {"eos_token_id": eos[0]}


def check_rope(rope, source: str, label: str = "rope"):
    for key in ("rope_theta", "factor", "beta_fast", "beta_slow"):
        if not _positive_number(getattr(rope, key)):
            raise ConfigError(f"{source}: {label} {key}={getattr(rope, key)!r} must be a positive finite number.")
    for key in ("mscale", "mscale_all_dim"):
        value = getattr(rope, key)
        if not _finite_number(value) or value < 0:
            raise ConfigError(f"{source}: {label} {key}={value!r} must be a finite number, 0 or more.")
    if rope.attention_factor is not None and not _positive_number(rope.attention_factor):
        raise ConfigError(f"{source}: {label} attention_factor={rope.attention_factor!r} must be a positive finite number.")
    original = rope.original_max_position_embeddings
    if not isinstance(original, int) or isinstance(original, bool) or not 0 < original <= 1 << 24:
        raise ConfigError(f"{source}: {label} original_max_position_embeddings={original!r} must be a positive integer.")
    if not isinstance(rope.truncate, bool):
        raise ConfigError(f"{source}: {label} truncate={rope.truncate!r} must be true or false.")


def _positive_number(value) -> bool:
    return _finite_number(value) and value > 0


def _finite_number(value) -> bool:
    """A float that is finite, or an int a float can hold (config.json may spell a 400-digit one)."""
    if isinstance(value, float):
        return math.isfinite(value)
    return type(value) is int and abs(value) < 1 << 63
