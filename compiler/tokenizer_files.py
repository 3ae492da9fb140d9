"""The tokenizer files a bundle carries from its checkpoint: `tokenizer.json` as it is, and the
chat template as `chat_template.json` ({"template", "bos_token", "eos_token"}), taken from
`chat_template.jinja` or else `tokenizer_config.json`'s "chat_template" (its "default" one when
it holds several), with the special-token strings templates use."""

import json
from pathlib import Path

from .recipe import RecipeError


def tokenizer_files(checkpoint: str | None) -> dict[str, bytes]:
    """Bundle name -> content, for what the checkpoint has."""
    if not checkpoint:
        return {}
    directory = Path(checkpoint)
    files = {}
    if (directory / "tokenizer.json").is_file():
        files["tokenizer.json"] = (directory / "tokenizer.json").read_bytes()
    template = _chat_template(directory)
    if template is not None:
        files["chat_template.json"] = json.dumps(template, ensure_ascii=False, indent=1).encode()
    return files


def _chat_template(directory: Path) -> dict | None:
    config_path = directory / "tokenizer_config.json"
    config = {}
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text())
        except ValueError as err:
            raise RecipeError(f"{config_path}: not valid JSON ({err}); fix or remove it.") from None
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}]
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None)
    if (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text()
    if not isinstance(template, str):
        return None
    return {"template": template, "bos_token": _token(config.get("bos_token")), "eos_token": _token(config.get("eos_token"))}


def _token(value) -> str:
    """A special token as tokenizer_config.json spells it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""
