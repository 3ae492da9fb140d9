"""Chat messages -> prompt text, with the checkpoint's chat template (carried in the bundle as
chat_template.json) rendered in jinja2's sandbox, as transformers renders it. Without one, a
documented plain default: each message as "<role>: <content>" on its own line, then
"assistant:" for the reply to continue."""

import json

from ..errors import DeepinferError

DEFAULT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
        try:
            self.template = env.from_string(source)
        except TemplateError as err:
            raise DeepinferError(f"the bundle's chat template does not parse ({err}).") from None
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def of_bundle(cls, executor) -> "ChatTemplate":
        """A loaded bundle's template (the file its manifest names, read through its verifying
        reader), or the plain default."""
        rel = executor.manifest.chat_template
        if rel is None:
            return cls(DEFAULT_TEMPLATE)
        path = executor.bundle / rel
        try:
            spec = json.loads(executor.files.text(rel))
            return cls(spec["template"], spec.get("bos_token") or "", spec.get("eos_token") or "")
        except (ValueError, KeyError, TypeError, DeepinferError) as err:
            raise DeepinferError(f"{path}: not a usable chat template ({err}); recompile the bundle from a checkpoint "
                                 "whose tokenizer_config.json or chat_template.jinja holds a valid one.") from None

    def render(self, messages: list[dict]) -> str:
        """Raises ValueError (the template's own complaint, e.g. roles out of order) on messages it refuses."""
        from jinja2 import TemplateError

        try:
            return self.template.render(messages=messages, add_generation_prompt=True, bos_token=self.bos_token,
                                        eos_token=self.eos_token)
        except TemplateError as err:
            raise ValueError(f"the chat template refused these messages: {err}") from None
