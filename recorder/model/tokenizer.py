"""Tokenizer + chat template, loaded once per server, used on every turn.

The hot path (encode / decode / render) runs on the raw `tokenizers` Rust
tokenizer and a jinja2 sandbox of our own, so the recorder never needs torch
and never pays for transformers' Python wrappers per turn. transformers is
only used to convert a `.gguf` tokenizer once into a cached Hugging Face
directory (that conversion imports torch).

Templates are rendered like transformers does (trim_blocks, lstrip_blocks,
`tojson` without HTML escaping, `raise_exception`, `strftime_now`), so a
model's own `chat_template` renders the same text here as there.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import re
from array import array
from collections.abc import Iterator, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _RawTokenizer

from recorder.dialects.chat import tool_json
from recorder.log.events import TokenizerIdentity
from recorder.model.byte_decoder import ByteDecoder
from recorder.model.word_cache import WordCache

TEMPLATES_DIR = Path(__file__).parent / "templates"
CACHE_ENV = "TR_TOKENIZER_CACHE"
# Texts longer than this are encoded by `encode_batch_fast` (see `Tokenizer.encode`):
# no offsets, ~15% less CPU from ~50 characters on (632 characters: 233 us instead
# of 273; 2,349: 986 instead of 1,264), and the GIL released while Rust works.
# Shorter ones take the plain call, cheaper than a batch of one (18 characters:
# 5.4 us instead of 6.0).
_GIL_FREE_CHARS = 64
# Long texts are tokenized in pieces of about this many characters (`encode_array`):
# the tokenizer holds ~90x the text it encodes at once (8 MB of text took ~1 GB),
# a piece of 64k characters ~6 MB. Cut only where a pre-tokenizer of the GPT-2 /
# Llama 3 / Qwen family always starts a new pre-token (merges never cross one):
# before a lone space between two non-blank characters, or after a lone newline
# followed by a non-blank character (the text before a cut ends in a non-blank
# or in one newline after one: at the end of a text, a run of blanks would
# become one pre-token where the whole text splits it). `_cuts_are_exact` checks the tokenizer agrees.
_PIECE_CHARS = 64 * 1024
_CUT = re.compile(r"(?<=\S) (?=\S)|(?<=\S\n)(?=\S)")
_CUT_LOOKBACK = 4096


class TooManyTokens(ValueError):
    """A text has more tokens than the caller's limit: `at_least` of them (all of them
    if `exact`); tokenizing stopped as soon as the limit was passed."""

    def __init__(self, at_least: int, limit: int, *, exact: bool) -> None:
        super().__init__(f"{'' if exact else 'at least '}{at_least} tokens > {limit}")
        self.at_least = at_least
        self.limit = limit
        self.exact = exact


class TokenizerLoadError(RuntimeError):
    """The tokenizer or its chat template could not be loaded."""


class TemplateNotIncremental(ValueError):
    """Rendering more messages changed the text of the earlier ones."""


class Tokenizer:
    """A fast tokenizer with a chat template and a stable identity."""

    def __init__(
        self,
        raw: _RawTokenizer,
        *,
        name_or_path: str,
        chat_template: str,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        special_tokens: dict[str, str] | None = None,
    ) -> None:
        self._raw = raw
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)
        self.pad_token_id: int = pad_token_id
        self.chat_template: str = chat_template
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self._template = _compile_template(chat_template)
        self.vocab_size: int = raw.get_vocab_size(with_added_tokens=True)
        self.identity = TokenizerIdentity(
            name_or_path=name_or_path,
            vocab_size=self.vocab_size,
            vocab_digest=_vocab_digest(raw),
            chat_template_digest=hashlib.sha256(chat_template.encode()).hexdigest(),
            eos_token_ids=self.eos_token_ids,
            pad_token_id=pad_token_id,
        )
        self.max_token_chars: int = _max_token_chars(raw)
        self.cuts_exact: bool = _cuts_are_exact(raw)
        self._words = WordCache.for_tokenizer(raw)
        self._bytes = ByteDecoder.for_tokenizer(raw)

    # -- ids <-> text -------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Ids for `text`; special-token strings in it map to their ids, nothing is added.

        All but the shortest texts go through `encode_batch_fast`, which tracks
        no offsets (less CPU, a fraction of the memory) and releases the GIL
        while Rust works (`encode` holds it: 8 MB of text froze every other
        thread of the server for 3.3 s). The ids are the same.

        ASCII text up to a piece's length (`_PIECE_CHARS`) is tokenized from the
        tokenizer's cached pre-token ids when it has them (`WordCache`): the
        same ids, ~5x less CPU for a turn's new messages and its TITO check.
        """
        if self._words is not None and len(text) <= _PIECE_CHARS:
            ids = self._words.encode(text)
            if ids is not None:
                return ids
        if len(text) < _GIL_FREE_CHARS:
            return self._raw.encode(text, add_special_tokens=False).ids
        return self._raw.encode_batch_fast([text], add_special_tokens=False)[0].ids

    def encode_array(self, text: str, limit: int | None = None) -> array:
        """Ids for `text` as an int32 array (4 bytes a token: a list of 16M ids is ~600 MB);
        raises TooManyTokens once more than `limit` ids are certain.

        A text longer than `max_token_chars * limit` is refused from its length
        alone. A long text is tokenized piece by piece (see `_PIECE_CHARS`),
        so memory stays ~6 MB plus the ids however long it is, and tokenizing
        stops at the first piece that passes `limit`. The ids are the same as
        one `encode` of the whole text (a tokenizer whose pre-tokenizer does not
        split where the pieces are cut is tokenized whole).
        """
        if limit is not None and len(text) // self.max_token_chars > limit:
            raise TooManyTokens(len(text) // self.max_token_chars, limit, exact=False)
        if len(text) <= _PIECE_CHARS or not self.cuts_exact:
            ids = array("i", self.encode(text))
            if limit is not None and len(ids) > limit:
                raise TooManyTokens(len(ids), limit, exact=True)
            return ids
        out = array("i")
        for piece, last in _pieces(text, _PIECE_CHARS):
            out.extend(self.encode(piece))
            if limit is not None and len(out) > limit:
                raise TooManyTokens(len(out), limit, exact=last)
        return out

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._raw.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`, special tokens included; from each id's bytes (`ByteDecoder`)
        when the tokenizer is byte-level: the same text for a fraction of the CPU."""
        if self._bytes is not None:
            text = self._bytes.decode(ids)
            if text is not None:
                return text
        return self._raw.decode(list(ids), skip_special_tokens=False)

    def decode_tokens(self, ids: Sequence[int]) -> list[str]:
        """One string per id (a lone byte of a multi-byte character shows as U+FFFD)."""
        return [self._raw.decode([i], skip_special_tokens=False) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self._raw.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The raw vocabulary entry (e.g. byte-level "Ġhello"), for debugging views."""
        return self._raw.id_to_token(token_id)

    # -- chat template ------------------------------------------------------

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The chat template's text for `messages` (not tokenized)."""
        context: dict[str, Any] = dict(self.special_tokens)
        context.update(template_kwargs)
        try:
            return self._template.render(
                messages=messages,
                tools=tools or None,
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template failed to render these messages: {exc}") from exc

    def render_within(
        self,
        limit: int | None,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """`render(...)`, raising TooManyTokens as soon as the text rendered so far
        certainly holds more than `limit` tokens (`max_token_chars` a token at most).

        The template's output is collected piece by piece (as jinja's own
        `render` does), so a prompt that cannot fit is refused without the
        copy that joins the pieces, and without rendering what follows.
        """
        if limit is None:
            return self.render(messages, tools, add_generation_prompt, **template_kwargs)
        context: dict[str, Any] = dict(self.special_tokens)
        context.update(template_kwargs)
        most = (limit + 1) * self.max_token_chars
        pieces: list[str] = []
        length = 0
        try:
            for piece in self._template.generate(
                messages=messages,
                tools=tools or None,
                add_generation_prompt=add_generation_prompt,
                **context,
            ):
                length += len(piece)
                if length >= most:
                    raise TooManyTokens(length // self.max_token_chars, limit, exact=False)
                pieces.append(piece)
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template failed to render these messages: {exc}") from exc
        return "".join(pieces)

    def render_suffix(
        self,
        messages: list[dict[str, Any]],
        start: int,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Text that `messages[start:]` (plus the generation prompt) adds after `messages[:start]`.

        Raises TemplateNotIncremental when the template renders the first
        `start` messages differently once more follow (such a template cannot
        extend a token chain).
        """
        head = self.render(messages[:start], tools, False, **template_kwargs) if start else ""
        full = self.render(messages, tools, add_generation_prompt, **template_kwargs)
        if not full.startswith(head):
            at = next((i for i, (a, b) in enumerate(zip(head, full, strict=False)) if a != b), 0)
            raise TemplateNotIncremental(
                f"the chat template re-renders earlier messages differently (first change at "
                f"character {at}: {head[at : at + 40]!r} -> {full[at : at + 40]!r}); use a "
                "template whose messages render independently (e.g. --chat-template "
                f"{TEMPLATES_DIR / 'chatml-tools.jinja'})"
            )
        return full[len(head) :]


# --------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------


def load_tokenizer(path: str, chat_template: str | None = None) -> Tokenizer:
    """Load a Hugging Face tokenizer directory or a `.gguf` file.

    `chat_template` is a path to a jinja file (or a bare name of one of
    ours, e.g. "chatml-tools") overriding the tokenizer's own template.
    """
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        directory = _gguf_cache_dir(p)
        if not (directory / "tokenizer.json").exists():
            convert_gguf_tokenizer(p, directory)
    elif p.is_dir():
        directory = p
    else:
        raise TokenizerLoadError(
            f"tokenizer path {path!r} is neither a directory with tokenizer.json nor a .gguf file"
        )
    return _load_dir(directory, name_or_path=str(path), chat_template=chat_template)


def convert_gguf_tokenizer(gguf_path: Path, out_dir: Path) -> Path:
    """Convert a GGUF file's tokenizer into a Hugging Face directory (imports torch)."""
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:  # pragma: no cover - transformers is a hard dependency
        raise TokenizerLoadError("loading a .gguf tokenizer needs transformers") from exc
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as exc:
        raise TokenizerLoadError(
            f"transformers could not read the tokenizer from {gguf_path}: {exc} "
            "(GGUF loading needs the 'tiny' extra: torch, gguf)"
        ) from exc
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    tok.save_pretrained(str(tmp))
    _drop_volatile_config_keys(tmp / "tokenizer_config.json")
    if out_dir.exists():  # another process converted it meanwhile
        _rmtree(tmp)
    else:
        os.replace(tmp, out_dir)
    return out_dir


def tokenizer_cache_root() -> Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "trajectory-recorder"


def bundled_template(name: str) -> Path:
    """Path of one of our templates, by bare name ("chatml-tools") or file name."""
    file = name if name.endswith(".jinja") else f"{name}.jinja"
    return TEMPLATES_DIR / file


def _load_dir(directory: Path, *, name_or_path: str, chat_template: str | None) -> Tokenizer:
    tok_file = directory / "tokenizer.json"
    if not tok_file.exists():
        raise TokenizerLoadError(
            f"{directory} has no tokenizer.json (slow tokenizers are not supported; "
            "save it with a fast tokenizer: AutoTokenizer.from_pretrained(...).save_pretrained(dir))"
        )
    raw = _RawTokenizer.from_file(str(tok_file))
    config = _read_json(directory / "tokenizer_config.json")
    special = {
        key: _token_content(config.get(key))
        for key in ("bos_token", "eos_token", "pad_token", "unk_token")
        if _token_content(config.get(key))
    }
    eos_ids = _eos_ids(raw, directory, special.get("eos_token"))
    pad = special.get("pad_token")
    pad_id = raw.token_to_id(pad) if pad else None
    if pad_id is None:
        pad_id = eos_ids[0] if eos_ids else 0
    template = _template_text(directory, config, chat_template)
    return Tokenizer(
        raw,
        name_or_path=name_or_path,
        chat_template=template,
        eos_token_ids=eos_ids,
        pad_token_id=pad_id,
        special_tokens=special,
    )


def _template_text(directory: Path, config: dict[str, Any], override: str | None) -> str:
    if override:
        candidate = Path(override)
        if not candidate.exists() and bundled_template(override).exists():
            candidate = bundled_template(override)
        try:
            return candidate.read_text()
        except OSError as exc:
            raise TokenizerLoadError(f"cannot read chat template {override!r}: {exc}") from exc
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if isinstance(template, str) and template:
        return template
    raise TokenizerLoadError(
        f"{directory} has no chat template; pass one with --chat-template FILE "
        f"(e.g. {bundled_template('chatml-tools')})"
    )


def _eos_ids(raw: _RawTokenizer, directory: Path, eos_token: str | None) -> tuple[int, ...]:
    ids: list[int] = []
    if eos_token and raw.token_to_id(eos_token) is not None:
        ids.append(raw.token_to_id(eos_token))  # type: ignore[arg-type]
    gen = _read_json(directory / "generation_config.json").get("eos_token_id")
    for i in gen if isinstance(gen, list) else [gen] if isinstance(gen, int) else []:
        if i not in ids:
            ids.append(i)
    return tuple(ids)


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _max_token_chars(raw: _RawTokenizer) -> int:
    """The most characters of text one token can stand for (added tokens included).

    A vocabulary entry is at least as long as the text it decodes to (a
    byte-level entry has one character per byte, a byte-fallback entry like
    `<0x0A>` is longer than its byte), so `len(text) / max_token_chars` is a
    lower bound on the tokens of `text`: a prompt whose text alone cannot fit
    the context is refused without tokenizing it.
    """
    return max(len(token) for token in raw.get_vocab(with_added_tokens=True))


def _pieces(text: str, size: int) -> Iterator[tuple[str, bool]]:
    """`text` in consecutive pieces of about `size` characters, cut where `_CUT` matches
    (a piece grows past `size` until a cut comes); (piece, is it the last)."""
    start = 0
    while len(text) - start > size:
        end = start + size
        cut = None
        for match in _CUT.finditer(text, max(start + 1, end - _CUT_LOOKBACK), end):
            cut = match.start()
        if cut is None:
            later = _CUT.search(text, end)
            if later is None:
                break
            cut = later.start()
        yield text[start:cut], False
        start = cut
    yield text[start:], True


_CUT_PROBE = (
    "def f(x):\n    return x * 2  # ünï 漢字 🙂\n\nclass A:\n\tpass\n"
    "Hello, world! It's 2024-01-02: 12345 + 678 = 13023.\n  indented\n"
    + "word " * 3
    + "<|im_start|>user\nhi<|im_end|>\n<|endoftext|> x\r\ny\n\n\nz  w   v\n!!! ??? ... ---\n"
)


def _cuts_are_exact(raw: _RawTokenizer) -> bool:
    """Does tokenizing in `_pieces` give the ids of the whole text, for this tokenizer?

    No added token may hold a cut (its text would be split), and a probe of
    code, prose, numbers, whitespace runs and special tokens cut at every
    place `_CUT` allows must tokenize as the whole. A tokenizer that prepends
    a marker to every text (SentencePiece's metaspace) fails the probe.
    """
    added = raw.get_added_tokens_decoder().values()
    if any(_CUT.search(token.content) for token in added):
        return False
    whole = raw.encode(_CUT_PROBE, add_special_tokens=False).ids
    pieced: list[int] = []
    for piece, _ in _pieces(_CUT_PROBE, 1):
        pieced.extend(raw.encode(piece, add_special_tokens=False).ids)
    return pieced == whole


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise TokenizerLoadError(f"cannot read {path}: {exc}") from exc


def _vocab_digest(raw: _RawTokenizer) -> str:
    vocab = raw.get_vocab(with_added_tokens=True)
    blob = json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


@lru_cache(maxsize=64)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_digest(path: Path) -> str:
    """sha256 of a file (memoised per path, size and mtime)."""
    st = path.stat()
    return _file_digest(str(path.resolve()), st.st_size, st.st_mtime_ns)


def _gguf_cache_dir(gguf: Path) -> Path:
    return tokenizer_cache_root() / "gguf-tokenizers" / file_digest(gguf)[:32]


def _drop_volatile_config_keys(config_file: Path) -> None:
    """Keep the saved config independent of where it was converted."""
    config = _read_json(config_file)
    for key in ("is_local", "local_files_only"):
        config.pop(key, None)
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------
# Jinja environment (transformers-compatible)
# --------------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask markers): render the body as is."""

    tags = {"generation"}  # noqa: RUF012 - jinja's API

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """As transformers' `tojson`; a tool schema's text is made once (`chat.tool_json`):
    every turn's render has the tools in it."""
    return tool_json(value, (ensure_ascii, indent, separators, sort_keys), _dumps)


def _dumps(
    value: Any,
    ensure_ascii: bool,
    indent: int | None,
    separators: tuple[str, str] | None,
    sort_keys: bool,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return _dt.datetime.now().strftime(fmt)


# Every name a plain dict's attribute lookup can find (dict and object attributes:
# a builtin type's are fixed), so any other name is certainly not an attribute.
_DICT_ATTRS = frozenset(dir(dict))


class _Sandbox(ImmutableSandboxedEnvironment):
    """jinja's immutable sandbox, with a shortcut for `message.role` on a plain dict.

    The sandbox's `getattr` tries the attribute first, and for a dict's key
    that costs a raised AttributeError before the item lookup (a chat
    template reads a dozen keys per message, every turn). A name that no
    plain dict has as an attribute goes straight to the item: exactly where
    the sandbox's own lookup ends, with the same result; every other object
    and name takes the sandbox's path.
    """

    def getattr(self, obj: Any, attribute: str) -> Any:
        if type(obj) is dict and attribute not in _DICT_ATTRS:
            try:
                return obj[attribute]
            except (TypeError, LookupError):
                return self.undefined(obj=obj, name=attribute)
        return super().getattr(obj, attribute)


@lru_cache(maxsize=32)
def _compile_template(source: str) -> jinja2.Template:
    env = _Sandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TokenizerLoadError(f"chat template has a syntax error: {exc}") from exc
