"""Per-session settings a trainer forces at open (`POST /sessions {"config": {...}}`).

`config.sampling` ({temperature, top_p, top_k, min_p, repetition_penalty,
frequency_penalty, presence_penalty, max_new_tokens, stop_token_ids}) replaces what
the agent asks for on every turn of the session: a rollout samples with the
trainer's settings, whatever the agent's CLI sends. `config.max_turns` caps the
session's engine calls; a request past it is refused (400, recorded as
RequestRejected), which stops the agent. Both live in SessionOpened.config, so
a restarted server restores them from the log.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from recorder.model.engine_wire import SamplingParams

_FORCED = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
)


# omit_defaults: every turn's state snapshot carries a session's overrides, and
# none set were ~145 bytes of field names and Nones there.
class SamplingOverride(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True
):
    temperature: Annotated[float, msgspec.Meta(ge=0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    top_k: int | None = None
    min_p: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0, le=2)] | None = None
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-2, le=2)] | None = None
    presence_penalty: Annotated[float, msgspec.Meta(ge=-2, le=2)] | None = None
    max_new_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    # Added to the stop tokens the tokenizer already knows (never replaces them).
    stop_token_ids: list[Annotated[int, msgspec.Meta(ge=0)]] | None = None

    @property
    def owns_distribution(self) -> bool:
        """Whether the trainer set any field that shapes the sampling distribution: then
        the request's own temperature, top_p and top_k are not taken (`turn`)."""
        return any(getattr(self, name) is not None for name in _FORCED)

    def apply(self, params: SamplingParams) -> SamplingParams:
        """`params` with the forced fields; max_new_tokens only ever lowers the clamped value."""
        changes: dict[str, Any] = {
            name: value for name in _FORCED if (value := getattr(self, name)) is not None
        }
        if self.stop_token_ids:
            extra = [t for t in self.stop_token_ids if t not in params.stop_token_ids]
            changes["stop_token_ids"] = (*params.stop_token_ids, *extra)
        if self.max_new_tokens is not None:
            changes["max_new_tokens"] = min(params.max_new_tokens, self.max_new_tokens)
        return msgspec.structs.replace(params, **changes) if changes else params


class SessionOverrides(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    sampling: SamplingOverride = SamplingOverride()
    max_turns: Annotated[int, msgspec.Meta(ge=1)] | None = None


class InvalidOverride(ValueError):
    """A config field that does not validate; the message names it."""


def overrides_from_config(config: dict[str, Any]) -> SessionOverrides:
    """The overrides in a session's config (other config keys are the trainer's own)."""
    known = {k: config[k] for k in ("sampling", "max_turns") if k in config}
    try:
        return msgspec.convert(known, SessionOverrides)
    except msgspec.ValidationError as exc:
        message = str(exc).replace("- at `$.", "- at `config.").replace("`$`", "`config`")
        raise InvalidOverride(message) from None
