"""parse_request with a session's ParseCache: the same ChatRequest and the same errors, bounded.

A simulated Claude Code session (billing header changing every turn, tool
loops, thinking, subagent requests interleaved on the same session) is
edited at random between turns the ways clients do: history rewound,
compacted, an echoed assistant message changed, an assistant turn split in
two, a role "system" message inserted, the whole body re-serialized. Every
body must parse to exactly what the uncached parse gives, with a roomy cache
and with caches so small or forgetful that they evict all the time.
"""

from __future__ import annotations

import gc
import json
import random
import tracemalloc
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_translate_fuzz import _body as garbage_bodies
from test_translate_requests import MALFORMED

import recorder.dialects.translate as translate
from recorder.dialects.chat import ChatRequest, InvalidRequest
from recorder.dialects.parse_cache import ChatMessages, ParseCache, pack_message, unpack_message
from recorder.dialects.translate import parse_request

Outcome = ChatRequest | tuple[str, str]


def _outcome(body: bytes, cache: ParseCache | None) -> Outcome:
    try:
        return parse_request(body, cache=cache)
    except InvalidRequest as exc:
        return (exc.field, str(exc))


def _assert_same(body: bytes, *caches: ParseCache) -> Outcome:
    expected = _outcome(body, None)
    for cache in caches:
        assert _outcome(body, cache) == expected
    return expected


def _assert_counted(outcome: Outcome) -> None:
    """`text_chars` is the length of the text of every user, tool and system message."""
    if isinstance(outcome, ChatRequest) and outcome.text_chars >= 0:
        rendered = [m for m in outcome.messages if m["role"] in ("user", "tool", "system")]
        assert outcome.text_chars == sum(len(m["content"]) for m in rendered)


_TOOLS = [
    {
        "name": name,
        "description": f"The {name} tool.",
        "input_schema": {"type": "object", "properties": {"arg": {"type": "string"}}},
        "cache_control": {"type": "ephemeral"},
    }
    for name in ("Bash", "Read", "Agent")
]


class _Session:
    """The client side of a Claude-Code-shaped session, with the edits clients make."""

    def __init__(self, rng: random.Random, system: str = "You are Claude Code.") -> None:
        self.rng = rng
        self.system = system
        self.turn = 0
        self.next_id = 0
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": self._words(8)}]
        self.dumps_kwargs: dict[str, Any] = {}
        self.messages_first = False  # Claude Code's own layout: the messages, then the rest

    def _words(self, n: int) -> str:
        return " ".join(
            self.rng.choice(["fix", "the", "test", "file", "run", "ok"]) for _ in range(n)
        )

    def body(self) -> bytes:
        self.turn += 1
        body = {
            "model": "claude",
            "max_tokens": 32000,
            "stream": True,
            "system": [
                {"type": "text", "text": f"x-anthropic-billing-header: cch={self.turn:05x};"},
                {"type": "text", "text": self.system, "cache_control": {"type": "ephemeral"}},
            ],
            "tools": _TOOLS,
            "messages": self.messages,
            "thinking": {"type": "adaptive"},
            "context_management": {"edits": []},
        }
        if self.messages_first:
            body = {"messages": body.pop("messages"), **body}
        return json.dumps(body, **self.dumps_kwargs).encode()

    def _assistant(self, n_calls: int) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if self.rng.random() < 0.5:
            content.append({"type": "thinking", "thinking": self._words(5), "signature": "sig"})
        if self.rng.random() < 0.7:
            content.append({"type": "text", "text": self._words(4)})
        for _ in range(n_calls):
            self.next_id += 1
            content.append(
                {
                    "type": "tool_use",
                    "id": f"toolu_{self.next_id:04d}",
                    "name": self.rng.choice(["Bash", "Read"]),
                    "input": {"arg": self._words(2)},
                }
            )
        if not content:
            content.append({"type": "text", "text": "done"})
        return {"role": "assistant", "content": content}

    def tool_turn(self) -> None:
        answer = self._assistant(self.rng.randint(1, 3))
        self.messages.append(answer)
        results: list[dict[str, Any]] = []
        for block in answer["content"]:
            if block["type"] == "tool_use":
                output: Any = self._words(self.rng.randint(1, 12))
                if self.rng.random() < 0.3:
                    output = [{"type": "text", "text": output}]
                result = {"type": "tool_result", "tool_use_id": block["id"], "content": output}
                if self.rng.random() < 0.2:
                    result["is_error"] = True
                results.append(result)
        if self.rng.random() < 0.3:
            results.append(
                {"type": "text", "text": "<system-reminder>keep going</system-reminder>"}
            )
        self.messages.append({"role": "user", "content": results})

    def text_turn(self) -> None:
        self.messages.append(self._assistant(0))
        self.messages.append({"role": "user", "content": self._words(6)})

    def rewind(self) -> None:
        """The user goes back to an earlier prompt (history truncated at a user message)."""
        ends = [i + 1 for i, m in enumerate(self.messages) if m["role"] == "user"]
        self.messages = self.messages[: self.rng.choice(ends)]

    def compact(self) -> None:
        """Claude Code's auto-compaction: a summary replaces the history."""
        summary = "This session is being continued. Summary: " + self._words(20)
        self.messages = [{"role": "user", "content": [{"type": "text", "text": summary}]}]

    def _assistant_indexes(self) -> list[int]:
        return [i for i, m in enumerate(self.messages) if m["role"] == "assistant"]

    def edit_echo(self) -> None:
        """The client changes an assistant message it echoes back."""
        indexes = self._assistant_indexes()
        if not indexes:
            return
        i = self.rng.choice(indexes)
        content = [dict(b) for b in self.messages[i]["content"]]
        edit = self.rng.choice(["drop_thinking", "whitespace", "text", "keys", "signature"])
        for block in content:
            if edit == "whitespace" and block["type"] == "text":
                block["text"] = "\n" + block["text"] + "  "
            elif edit == "text" and block["type"] == "text":
                block["text"] += " (edited)"
            elif edit == "signature" and block["type"] == "thinking":
                block["signature"] = "other"
        if edit == "drop_thinking":
            content = [b for b in content if b["type"] != "thinking"] or content
        elif edit == "keys":
            content = [dict(reversed(list(b.items()))) for b in content]
        self.messages[i] = {"role": "assistant", "content": content}

    def split_assistant(self) -> None:
        """One assistant turn sent as two consecutive assistant messages (they merge)."""
        indexes = [i for i in self._assistant_indexes() if len(self.messages[i]["content"]) > 1]
        if not indexes:
            return
        i = self.rng.choice(indexes)
        content = self.messages[i]["content"]
        cut = self.rng.randint(1, len(content) - 1)
        self.messages[i : i + 1] = [
            {"role": "assistant", "content": content[:cut]},
            {"role": "assistant", "content": content[cut:]},
        ]

    def drop_assistant(self) -> None:
        """A broken client: an assistant turn is gone but its tool results stay (a 400)."""
        indexes = self._assistant_indexes()
        if indexes:
            del self.messages[self.rng.choice(indexes)]

    def insert_system(self) -> None:
        i = self.rng.randrange(len(self.messages))
        self.messages.insert(i, {"role": "system", "content": "Note: " + self._words(3)})

    def reserialize(self) -> None:
        """Same JSON values, different bytes for every message."""
        self.dumps_kwargs = self.rng.choice([{}, {"indent": 1}, {"separators": (",", ":")}])


_EDITS = [
    "tool_turn",
    "tool_turn",
    "tool_turn",
    "text_turn",
    "rewind",
    "compact",
    "edit_echo",
    "split_assistant",
    "insert_system",
    "drop_assistant",
    "reserialize",
    "subagent",
]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(_EDITS), min_size=1, max_size=30), st.integers(0, 2**32 - 1))
def test_cached_parse_equals_uncached_over_an_edited_session(edits: list[str], seed: int) -> None:
    _edited_session(edits, seed, messages_first=False)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(_EDITS), min_size=1, max_size=30), st.integers(0, 2**32 - 1))
def test_cached_parse_equals_uncached_with_the_messages_first(edits: list[str], seed: int) -> None:
    """Claude Code's layout: a body that repeats the last one's messages byte for byte
    and appends some is parsed from what follows them (`ParseCache.known_prefix`)."""
    _edited_session(edits, seed, messages_first=True)


def _edited_session(edits: list[str], seed: int, *, messages_first: bool) -> None:
    rng = random.Random(seed)
    main = _Session(rng)
    main.messages_first = messages_first
    roomy, tiny = ParseCache(), ParseCache(max_entries=3, max_bytes=3000)
    forgetful = ParseCache(max_idle_requests=0)  # keeps only what the last request used
    caches = (roomy, tiny, forgetful)
    _assert_same(main.body(), *caches)
    subagent: _Session | None = None
    for edit in edits:
        if edit == "subagent":
            # A subagent's requests arrive on the same session, between the main line's.
            subagent = subagent or _Session(rng, system="You are a subagent.")
            subagent.messages_first = messages_first
            subagent.tool_turn()
            _assert_counted(_assert_same(subagent.body(), *caches))
        else:
            getattr(main, edit)()
        _assert_counted(_assert_same(main.body(), *caches))
        assert len(tiny) <= 3 and tiny.nbytes <= 3000


def test_only_new_messages_are_translated(monkeypatch: pytest.MonkeyPatch) -> None:
    translated: list[str] = []
    original = translate._translate_message

    def counting(message: translate.Message, path: str, seen: set[str]) -> Any:
        translated.append(path)
        return original(message, path, seen)

    monkeypatch.setattr(translate, "_translate_message", counting)
    session, cache = _Session(random.Random(1)), ParseCache()
    for _ in range(10):
        session.tool_turn()
    assert parse_request(session.body(), cache=cache) == parse_request(session.body())
    translated.clear()
    session.tool_turn()
    n = len(session.messages)
    assert parse_request(session.body(), cache=cache) == parse_request(session.body())
    # The uncached parse translated all n; the cached one only the two new messages.
    assert translated.count(f"messages.{n - 2}") == 2
    assert len(translated) == n + 2
    translated.clear()
    session.edit_echo()
    session.reserialize()
    session.dumps_kwargs = {"indent": 2}  # every message's bytes change: all translated again
    parse_request(session.body(), cache=cache)
    assert len(translated) == n


def test_a_same_length_edit_in_place_is_translated_anew(monkeypatch: pytest.MonkeyPatch) -> None:
    """A message at the same position and offset, same length, one byte changed: the
    position match must compare the bytes, not trust the position or the length."""
    translated: list[str] = []
    original = translate._translate_message

    def counting(message: translate.Message, path: str, seen: set[str]) -> Any:
        translated.append(path)
        return original(message, path, seen)

    monkeypatch.setattr(translate, "_translate_message", counting)
    session, cache = _Session(random.Random(5)), ParseCache()
    for _ in range(6):
        session.tool_turn()
    session.messages[0]["content"] = "aaaa"
    first = session.body()
    assert parse_request(first, cache=cache) == parse_request(first)
    session.messages[0]["content"] = "aaab"
    second = session.body()
    assert len(second) == len(first)
    translated.clear()
    assert parse_request(second, cache=cache) == parse_request(second)
    assert translated.count("messages.0") == 2  # the uncached parse and the cached one
    assert len(translated) == len(session.messages) + 1


def test_the_cache_keeps_digests_not_copies_of_the_messages() -> None:
    """Keys are 16-byte digests; the cache keeps no message bytes alive: neither the
    previous body (~0.5 MB at 100k tokens) nor views into it."""
    session, cache = _Session(random.Random(6)), ParseCache()
    for _ in range(30):
        session.tool_turn()
        parse_request(session.body(), cache=cache)
    assert len(cache) > 30
    assert {len(key) for key in cache._entries} == {16}
    body = session.body()
    parse_request(body, cache=cache)
    reached = _reachable(cache)
    assert id(body) not in reached
    kinds = {type(o) for o in reached.values()}
    assert msgspec.Raw not in kinds and memoryview not in kinds
    # Beside the 16-byte keys, only packed translations (msgpack, `pack_message`): no
    # copy of a message's JSON, nor of any other part of the body.
    kept = [o for o in reached.values() if isinstance(o, bytes) and len(o) > 16]
    assert all(o[:1] != b"{" and o not in body for o in kept)
    assert all(isinstance(unpack_message(o), dict) for o in kept)
    # A message moved to another position is still a hit (found by its digest).
    session.messages.insert(1, {"role": "user", "content": "inserted"})
    session.messages.insert(2, {"role": "assistant", "content": "noted"})
    entries = len(cache)
    _assert_same(session.body(), cache)
    assert len(cache) == entries + 2
    # A body that appends to the previous one is still found by its prefix.
    session.messages_first = True
    parse_request(session.body(), cache=cache)
    session.tool_turn()
    assert cache.known_prefix(session.body()) is not None


def _cached_session(turns: int) -> tuple[_Session, ParseCache]:
    session, cache = _Session(random.Random(2)), ParseCache()
    for _ in range(turns):
        session.tool_turn()
        parse_request(session.body(), cache=cache)
    return session, cache


def _error(body: bytes, cache: ParseCache | None) -> str:
    with pytest.raises(InvalidRequest) as info:
        parse_request(body, cache=cache)
    return str(info.value)


def test_malformed_new_message_in_a_cached_body_names_its_field() -> None:
    session, cache = _cached_session(8)
    n = len(session.messages)
    valid = session.body()
    session.messages.append({"role": "assistant", "content": "Let me look."})
    session.messages.append(
        {"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "document"}]}
    )
    body = session.body()
    expected = f"messages.{n + 1}.content.1.type: unsupported block type 'document'"
    assert _error(body, cache) == _error(body, None) == expected
    session.messages[-1] = {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}],
    }
    body = session.body()
    expected = (
        f"messages.{n + 1}.content.0.tool_use_id: "
        "no tool_use with id 'toolu_nope' earlier in the conversation"
    )
    assert _error(body, cache) == _error(body, None) == expected
    # A cached assistant message as the last one is a prefill.
    del session.messages[-1]
    body = session.body()
    assert _error(body, cache) == _error(body, None)
    assert _error(body, cache).startswith(f"messages.{n}.role: ")
    # The failures left the cache usable.
    assert parse_request(valid, cache=cache) == parse_request(valid)


def test_cached_tool_result_whose_tool_use_is_gone_is_refused() -> None:
    session, cache = _cached_session(6)
    # Drop an assistant turn but keep its (cached, byte-identical) tool results.
    i = next(i for i, m in enumerate(session.messages) if m["role"] == "assistant")
    del session.messages[i]
    body = session.body()
    assert _error(body, cache) == _error(body, None)
    assert _error(body, cache).startswith(f"messages.{i}.content.0.tool_use_id: no tool_use")


def test_malformed_table_with_a_warm_cache() -> None:
    """Every refusal of the table, with one cache shared by all (the second pass hits it)."""
    cache = ParseCache()
    for _ in range(2):
        for name, body, _, _ in MALFORMED:
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            assert _outcome(raw, cache) == _outcome(raw, None), name
    assert len(cache) > 0


def test_cache_is_bounded_by_entries_and_bytes() -> None:
    session = _Session(random.Random(3))
    for _ in range(20):
        session.tool_turn()
    body = session.body()
    by_entries = ParseCache(max_entries=5)
    by_bytes = ParseCache(max_bytes=4000)
    for _ in range(2):
        _assert_same(body, by_entries, by_bytes)
        assert len(by_entries) == 5
        assert 0 < by_bytes.nbytes <= 4000
    roomy = ParseCache()
    _assert_same(body, roomy)
    assert len(roomy) == len(session.messages)
    assert roomy.nbytes >= sum(len(json.dumps(m)) for m in session.messages)
    roomy.clear()
    assert len(roomy) == 0 and roomy.nbytes == 0
    _assert_same(body, roomy)


def test_message_larger_than_the_byte_bound_is_not_kept() -> None:
    session = _Session(random.Random(4))
    session.messages[0]["content"] = "x" * 10_000
    cache = ParseCache(max_bytes=5000)
    _assert_same(session.body(), cache)
    assert len(cache) == 0 and cache.nbytes == 0
    assert cache.known_prefix(session.body()) is None  # nor the request remembered


def _reachable(root: object) -> dict[int, object]:
    """Every object reachable from `root` through the references the gc sees."""
    out: dict[int, object] = {}
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in out or isinstance(obj, type):
            continue
        out[id(obj)] = obj
        stack.extend(gc.get_referents(obj))
    return out


_SHARED = ParseCache(max_entries=64)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(garbage_bodies)
def test_garbage_bodies_parse_the_same_with_a_shared_cache(body: dict[str, Any]) -> None:
    raw = json.dumps(body).encode()
    assert _outcome(raw, _SHARED) == _outcome(raw, None)
    assert _outcome(raw, _SHARED) == _outcome(raw, None)  # now with its messages cached


def test_messages_no_request_uses_any_more_are_dropped() -> None:
    session, cache = _Session(random.Random(5)), ParseCache(max_idle_requests=2)
    for _ in range(10):
        session.tool_turn()
        _assert_same(session.body(), cache)
    assert len(cache) == len(session.messages)
    session.compact()
    for _ in range(3):
        session.tool_turn()
        _assert_same(session.body(), cache)
    # The history the compaction replaced went after two requests without it.
    assert len(cache) == len(session.messages) == 7


def _nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    "where",
    ["new message", "tools", "metadata", "new message int", "first message"],
)
def test_json_limits_hold_with_a_warm_cache(where: str) -> None:
    """With a cache only unseen bytes are scanned for JSON limits: a too-deep value or a
    too-big integer anywhere new (a message, the tools, metadata) is still the same 400."""
    base: dict[str, Any] = {
        "model": "m",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}],
        "tools": [{"name": "Bash", "input_schema": {"type": "object"}}],
    }
    cache = ParseCache()
    parse_request(json.dumps({**base, "messages": [*base["messages"][:1]]}).encode(), cache=cache)
    call = {"type": "tool_use", "id": "toolu_1", "name": "Bash"}
    body = dict(base)
    if where == "new message":
        body["messages"] = [*base["messages"], {"role": "assistant", "content": [
            {**call, "input": {"a": _nested(300)}}]}, {"role": "user", "content": "go"}]  # fmt: skip
    elif where == "new message int":
        body["messages"] = [*base["messages"], {"role": "assistant", "content": [
            {**call, "input": {"a": 10**30}}]}, {"role": "user", "content": "go"}]  # fmt: skip
    elif where == "first message":
        body["messages"] = [{"role": "user", "content": "hi", "x": _nested(300)}]
    elif where == "tools":
        body["tools"] = [{"name": "Bash", "input_schema": {"a": _nested(300)}}]
        body["messages"] = [*base["messages"], {"role": "user", "content": "go"}]
    else:
        body["metadata"] = {"n": 10**30}
        body["messages"] = [*base["messages"], {"role": "user", "content": "go"}]
    raw = json.dumps(body).encode()
    field, message = _assert_same(raw, cache)  # type: ignore[misc]
    assert field == "body" and ("levels deep" in message or "64 bits" in message)


def test_the_cache_keeps_few_objects_for_the_cyclic_gc_to_walk() -> None:
    """Every full collection walks every tracked object: a restarted server's caches fill
    with hundreds of messages per session at once. A cached message is a plain tuple of
    strings and flat dicts (the tuple around its dicts stays tracked), not an object per
    entry: at most ~2 tracked objects each (3 with an object per entry)."""
    import gc

    messages: list[dict[str, Any]] = []
    for k in range(100):
        messages += [
            {"role": "user", "content": [{"type": "text", "text": f"step {k}"}]},
            {"role": "assistant", "content": f"answer {k}"},
        ]
    messages.append({"role": "user", "content": "go on"})
    body = json.dumps({"model": "m", "max_tokens": 8, "messages": messages}).encode()
    gc.collect()
    before = len(gc.get_objects())
    cache = ParseCache()
    parse_request(body, cache=cache)
    gc.collect()
    tracked = len(gc.get_objects()) - before
    assert len(cache) == len(messages)
    assert tracked <= 2 * len(cache) + 20, tracked


def _decoded_sizes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every body the cached parse decodes (the raw-messages decoder)."""
    sizes: list[int] = []
    decoder = translate.raw_messages_decoder

    class Counting:
        def decode(self, data: bytes) -> Any:
            sizes.append(len(data))
            return decoder.decode(data)

    monkeypatch.setattr(translate, "raw_messages_decoder", Counting())
    return sizes


def test_a_body_that_appends_messages_is_decoded_from_the_new_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    session, cache = _Session(random.Random(7)), ParseCache()
    session.messages_first = True
    for _ in range(30):
        session.tool_turn()
        _assert_same(session.body(), cache)
    sizes = _decoded_sizes(monkeypatch)
    session.tool_turn()
    body = session.body()
    _assert_same(body, cache)
    # The fields around the messages and the two new ones: a fraction of the body.
    assert len(sizes) == 1 and sizes[0] < len(body) // 4
    # The same body again (a retry): nothing after the known messages but the rest.
    _assert_same(body, cache)
    assert len(sizes) == 2 and sizes[1] < sizes[0]


@pytest.mark.parametrize(
    "tail",
    [
        b", ]",  # a trailing comma: not JSON, though the rest alone would be
        b",]",
        b' , {"role": "user"}]',  # a new message without content
        b', {"role": "user", "content": "x"}',  # the list never ends
        b" x]",
        b"",
        b", 7]",
        b', {"role": "user", "content": [{"type": "text", "text": "hi", "x": '
        + b"[" * 200
        + b"]" * 200
        + b"}]}]",
    ],
)
def test_what_follows_known_messages_is_refused_as_without_the_cache(tail: bytes) -> None:
    session, cache = _Session(random.Random(8)), ParseCache()
    session.messages_first = True
    for _ in range(4):
        session.tool_turn()
    body = session.body()
    _assert_same(body, cache)
    close = body.index(b', "model"') - 1  # the "]" that ends the messages
    assert body[close : close + 1] == b"]"
    bad = body[:close] + tail + body[close + 1 :]
    expected = _outcome(bad, None)
    assert isinstance(expected, tuple)  # refused
    assert _outcome(bad, cache) == expected
    _assert_same(session.body(), cache)  # and the cache is still right afterwards


def test_known_messages_under_another_system_prompt_are_translated_as_such() -> None:
    session, cache = _Session(random.Random(9)), ParseCache()
    session.messages_first = True
    for _ in range(5):
        session.tool_turn()
        _assert_same(session.body(), cache)
    session.system = "You are another agent."
    session.tool_turn()
    _assert_same(session.body(), cache)
    body = session.body().replace(b'"stream": true', b'"stream": false')
    _assert_same(body, cache)


def test_the_cache_keeps_translations_packed_and_a_turn_unpacks_what_it_reads() -> None:
    """Between requests a session keeps no dict of its messages: its entries and the
    state for the next request hold them packed (~half the memory); a request unpacks
    only the messages read (an extending turn reads its new ones), and reading all of
    them gives the uncached parse's messages."""
    session, cache = _Session(random.Random(8)), ParseCache()
    session.messages_first = True  # Claude Code's layout: found by `known_prefix`
    for _ in range(20):
        session.tool_turn()
        parse_request(session.body(), cache=cache)
    session.tool_turn()
    body = session.body()
    assert cache.known_prefix(body) is not None
    chat = parse_request(body, cache=cache)
    packed = [m for piece in cache._entries.values() for m in piece[1]]
    assert packed and all(isinstance(m, bytes) for m in packed)
    state = cache.known_prefix(body).state  # type: ignore[union-attr]
    kept = [m for m in state.messages if not isinstance(m, bytes)]
    assert all(m["role"] == "system" for m in kept)  # the system prompt: `state.system` itself
    assert isinstance(chat.messages, ChatMessages)
    n = len(chat.messages)
    new = chat.messages[n - 2 :]
    items = chat.messages._items
    assert sum(isinstance(m, bytes) for m in items) >= n - 2 - len(kept)
    uncached = parse_request(body)
    assert new == uncached.messages[n - 2 :]
    assert list(chat.messages) == uncached.messages and chat == uncached
    assert not any(isinstance(m, bytes) for m in items)


def test_a_packed_message_holds_the_memory_of_its_packed_size() -> None:
    """A compressed entry's allocation is its length: zstandard's `compress` allocates
    the frame's worst-case bound (more than its input), which a kept frame would keep
    alive, the message's whole size, where the census sees only the frame's length."""
    text = " ".join(f"line {i % 50} of a tool result" for i in range(2000))
    message = {"role": "tool", "content": text}
    packed = pack_message(message)
    assert len(packed) < len(text) // 4 and unpack_message(packed) == message
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = [pack_message(message) for _ in range(20)]
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 20 * (len(packed) + 256), (held, len(packed))
    assert all(k == packed for k in kept)


def test_the_fields_around_the_messages_are_scanned_once_while_unchanged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A session re-sends the same system prompt and tools every turn: their JSON-limit
    scan (~0.3-1 ms for Claude Code's) is kept by their digest; new messages are still
    scanned, and other tools are scanned anew."""
    scanned: list[bytes] = []
    real = translate.json_problem

    def counting(data: bytes, *args: Any) -> str | None:
        scanned.append(data)
        return real(data, *args)

    monkeypatch.setattr(translate, "json_problem", counting)
    monkeypatch.setattr(translate, "_OUTSIDE_OK", set())
    tools = [{"name": f"T{k}", "input_schema": {"type": "object", "k": [k]}} for k in range(40)]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    cache = ParseCache()
    outside_scans = []
    for turn in range(4):
        body = {"model": "m", "max_tokens": 8, "messages": messages, "tools": tools}
        parse_request(json.dumps(body).encode(), cache=cache)
        outside_scans.append(sum(b'"tools"' in d for d in scanned))
        messages = [*messages, {"role": "assistant", "content": f"a{turn}"}]
        messages.append({"role": "user", "content": f"u{turn}"})
    # The first body (its whole list of messages cut out) and the first resumed one
    # (the new messages cut out of the shortened body) are scanned; later turns are not.
    assert outside_scans[0] == 1 and outside_scans[-1] == outside_scans[1] <= 2
    assert sum(b'"u1"' in d for d in scanned) == 1  # a new message: scanned on its own
    tools.append({"name": "Extra", "input_schema": {"a": _nested(300)}})
    body = {"model": "m", "max_tokens": 8, "messages": messages, "tools": tools}
    with pytest.raises(InvalidRequest):
        parse_request(json.dumps(body).encode(), cache=cache)
