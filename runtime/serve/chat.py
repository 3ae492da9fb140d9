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
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", where: str = "the default chat template"):
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
            raise DeepinferError(f"the chat template does not parse ({err}).") from None
        self.source, self.bos_token, self.eos_token, self.where = source, bos_token, eos_token, where

    @classmethod
    def of_bundle(cls, executor) -> "ChatTemplate":
        """A loaded bundle's template (the file its manifest names, read through its verifying
        reader), or the plain default."""
        rel = executor.manifest.chat_template
        if rel is None:
            return cls(DEFAULT_TEMPLATE)
        return cls.of_json(executor.files.text(rel), str(executor.bundle / rel))

    @classmethod
    def of_json(cls, text: str, where: str) -> "ChatTemplate":
        """A chat_template.json: {"template", "bos_token", "eos_token"}."""
        try:
            spec = json.loads(text)
            return cls(spec["template"], spec.get("bos_token") or "", spec.get("eos_token") or "", where)
        except (ValueError, KeyError, TypeError, AttributeError, DeepinferError) as err:
            raise DeepinferError(f"{where}: not a usable chat template ({err}); recompile the bundle from a checkpoint "
                                 "whose tokenizer_config.json or chat_template.jinja holds a valid one.") from None

    def spec(self) -> dict:
        """What a render worker needs to build the same template."""
        return {"template": self.source, "bos_token": self.bos_token, "eos_token": self.eos_token}

    def render(self, messages: list[dict], tools: list[dict] | None = None, kwargs: dict | None = None) -> str:
        """In this process, unbounded (the server renders through template_worker). `tools`: the
        request's function tools (templates that list them read `tools`); `kwargs`: the request's
        chat_template_kwargs (e.g. DeepSeek's `thinking`). Raises ValueError on any failure: the
        template's own complaint (roles out of order), or its bug."""
        try:
            return self.template.render(**(kwargs or {}), messages=messages, tools=tools, add_generation_prompt=True,
                                        bos_token=self.bos_token, eos_token=self.eos_token)
        except Exception as err:  # a template is code: 1/0, messages + 1, the sandbox saying no ...
            raise ValueError(f"{type(err).__name__}: {err}") from None
