"""SGLang's `/generate` request contract, as the test engines apply it.

SGLang's HTTP server checks every `/generate` body against its API schema
(`sglang.srt.entrypoints.api_contract.generate_contract_error`) before it
accepts it: unknown sampling keys, `"1"` or `1.5` for an integer, `1` for a
boolean are HTTP 400; `null` means the default. The test engines must refuse
exactly those bodies, so a recorder bug that SGLang would reject cannot pass
here. When SGLang is importable (CI installs it) its own check runs; otherwise
the mirror below, the same schema written as msgspec Structs for the fields a
test engine reads (tests/engine/test_sglang_contract.py proves both agree).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import msgspec

from recorder.model import sglang_compat

StrOrList = str | list[str]


class _Strict(msgspec.Struct, forbid_unknown_fields=True):
    pass


class Watermark(_Strict):
    enabled: bool | None = None
    key: str | None = None
    context_window: int | None = None


class SamplingContract(_Strict):
    """Every sampling key SGLang 0.5.23 knows; any other key is refused."""

    max_new_tokens: int | None = None
    stop: StrOrList | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: StrOrList | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    min_new_tokens: int | None = None
    n: int | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    stream_interval: int | None = None
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None
    custom_params: Any = None
    beam_width: int | None = None
    watermark: Watermark | None = None
    choice: list[str] | None = None


class GenerateContract(msgspec.Struct):
    """The top-level fields a test engine reads; others are not checked (SGLang ignores
    unknown top-level keys)."""

    rid: StrOrList | None = None
    text: StrOrList | None = None
    input_ids: list[int | list[int]] | None = None
    stream: bool | None = None
    sampling_params: SamplingContract | list[SamplingContract] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool | None = None


def mirror_contract_error(body: Any) -> str | None:
    """The mirror's verdict on a parsed `/generate` body: None, or why it is refused."""
    try:
        msgspec.convert(body, GenerateContract)
    except msgspec.ValidationError as exc:
        return str(exc)
    return None


@cache
def _checker() -> Any:
    try:
        return sglang_compat.load("srt.entrypoints.api_contract").generate_contract_error
    except sglang_compat.SglangUnavailable:
        return mirror_contract_error


def contract_error(body: Any) -> str | None:
    """SGLang's own verdict when it is importable, else the mirror's."""
    return _checker()(body)


def contract_source() -> str:
    """Which check `contract_error` runs ('sglang X.Y.Z' or 'mirror')."""
    checker = _checker()
    return "mirror" if checker is mirror_contract_error else f"sglang {sglang_compat.version()}"
