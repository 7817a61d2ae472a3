"""Chains of exact tokens: which earlier turn a request continues, and its engine input.

A chain is a run of turns in which each turn's input is the previous turn's
input + output, token for token. Extending a chain reuses the model's raw
output tokens verbatim (never decode -> re-encode them) and tokenizes only what
is new: the template's closing glue after the last output and the newly added
messages with the generation prompt. So the cost of a turn grows with the new
tokens, not with the context.

Everything here is pure logic over a `Tokenizer` passed in (no I/O). The server
calls, per request and under the session's lock:
    plan = plan_turn(chains, req, tok)      # decide, build input_ids
    ... engine ...
    commit_turn(chains, plan, output_ids, response_message_digest(content))
    note_dispatch(chains, ids, prompts)     # Agent/Task tool_use in the response
`plan_turn` changes nothing but a chain-id counter, so a failed turn leaves the
chains as they were. Replaying those calls over a session's recorded requests
and outputs rebuilds the same state after a restart.

One module (~700 lines) on purpose: planning and committing read and write
the same `SessionChains` state, and the rules that decide a request's chain
(extend, retry, compaction beside, side request, subagent claim) are one
decision, read top to bottom in `plan_turn`.
"""

from __future__ import annotations

import operator
import weakref
from array import array
from collections.abc import Sequence
from typing import Any, Literal, Protocol

import msgspec
import numpy as np

from recorder.dialects.chat import ChatRequest, same_message
from recorder.model.tokenizer import TooManyTokens

DEFAULT_MAX_CHAINS = 32
MAX_PENDING_DISPATCHES = 64

Action = Literal["extend", "new"]
Reason = Literal["first", "extends", "compaction", "subagent", "diverged", "side"]

# Content for the assistant message of the fixed render prefix: the text after
# it in the template's output is the assistant turn's closing.
_SENTINEL = "\u2063TRAJECTORY-RECORDER-ASSISTANT-SENTINEL\u2063"
_PREFIX_MESSAGES: tuple[dict[str, Any], ...] = (
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U"},
    {"role": "assistant", "content": _SENTINEL},
)


_MISSING = object()
# A render prefix longer than this (tools of megabytes) is not cached.
_MAX_CACHED_HEAD = 1 << 20
_PIECES: weakref.WeakKeyDictionary[Any, dict[str, tuple[str, str] | None]] = (
    weakref.WeakKeyDictionary()
)


class Tokenizer(Protocol):
    """What this module needs of `recorder.model.tokenizer.Tokenizer`."""

    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def encode_array(self, text: str, limit: int | None = None) -> array: ...

    max_token_chars: int

    def render_within(
        self,
        limit: int | None,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str: ...


class ContextOverflow(ValueError):
    """The prompt leaves no room to generate within the context length."""

    def __init__(self, input_len: int, context_length: int, *, at_least: bool = False) -> None:
        super().__init__(
            f"prompt is too long: {'at least ' if at_least else ''}{input_len} tokens > "
            f"{context_length - 1} maximum (context length {context_length}); compact the "
            "conversation or start a new session"
        )
        self.input_len = input_len
        self.context_length = context_length


# --------------------------------------------------------------------------
# State
# --------------------------------------------------------------------------


class Boundary(msgspec.Struct, array_like=True, frozen=True):
    """A committed turn of a chain: where its input and its output ended."""

    n_input_messages: int
    input_len: int
    end_len: int
    ended_with_eos: bool


class Chain(msgspec.Struct, kw_only=True):
    """One chain of exact tokens and the normalized messages it covers.

    `tokens` = the last turn's input + output (model outputs verbatim), held as
    int32 to keep hundreds of 100k-token sessions in memory.
    `message_digests` covers every request message and, last, the assistant
    message the client will echo for our latest answer.
    """

    chain_id: int
    system_digest: str
    render_digest: str
    message_digests: list[str]
    tokens: array
    boundaries: list[Boundary]
    main_line: bool
    parent_chain_id: int | None = None
    dispatch_tool_use_id: str | None = None
    last_used: int = 0
    n_tools: int = -1  # tools its requests offer (-1: not known)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def ended_with_eos(self) -> bool:
        return self.boundaries[-1].ended_with_eos if self.boundaries else False


class PendingDispatch(msgspec.Struct, array_like=True, frozen=True):
    """An Agent/Task dispatch whose tool_result has not come back to the main line yet.

    `chain_id` is the subagent chain it started, None until its first request.
    `returned`: the tool_result came back before any subagent request (a
    background agent, "Async agent launched"); its first request still
    claims it, and then the dispatch is done.
    """

    tool_use_id: str
    prompt: str = ""
    chain_id: int | None = None
    returned: bool = False


class SessionChains(msgspec.Struct, kw_only=True):
    """All chains of one session (bounded: least recently used side chains are dropped)."""

    chains: dict[int, Chain] = msgspec.field(default_factory=dict)
    main_chain_id: int | None = None
    pending_dispatches: list[PendingDispatch] = msgspec.field(default_factory=list)
    next_chain_id: int = 0
    clock: int = 0
    max_chains: int = DEFAULT_MAX_CHAINS

    @property
    def main(self) -> Chain | None:
        return None if self.main_chain_id is None else self.chains.get(self.main_chain_id)


class TurnPlan(msgspec.Struct, kw_only=True):
    """The decision for one request and the engine input it implies.

    input_ids[:prefix_len] are reused chain tokens; the rest were tokenized now.
    They are an int32 `array`, as chain tokens are: slicing a 100k-token chain
    is then a copy of 400 kB, where a list would build 100k Python ints (~3.5 ms).
    `closing_inserted` counts tokens inserted to close an output that did not end
    with EOS (they belong to the inserted part, after prefix_len). `fallback`
    says why a matching chain could not be extended, if that happened.
    """

    chain_id: int
    action: Action
    reason: Reason
    parent_chain_id: int | None
    input_ids: array
    prefix_len: int
    new_messages: int
    dispatch_tool_use_id: str | None = None
    closing_inserted: int = 0
    main_line: bool = False
    request_digests: tuple[str, ...] = ()
    system_digest: str = ""
    render_digest: str = ""
    n_tools: int = -1
    returned_dispatch_ids: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    fallback: str = ""

    @property
    def new_tokens(self) -> int:
        return len(self.input_ids) - self.prefix_len


class TitoResult(msgspec.Struct, frozen=True):
    ok: bool
    first_divergence: int | None
    reencoded_ids: list[int]


# --------------------------------------------------------------------------
# Planning
# --------------------------------------------------------------------------


class _Match(msgspec.Struct):
    chain: Chain
    boundary: Boundary
    n_messages: int  # request messages already covered by the chain's tokens
    is_end: bool
    is_retry: bool  # the request re-sends a turn's input exactly


def plan_turn(
    chains: SessionChains, req: ChatRequest, tok: Tokenizer, context_length: int | None = None
) -> TurnPlan:
    """Decide which chain `req` continues and build its full engine input.

    With `context_length`, raises ContextOverflow as soon as the input is
    certain to leave no room to generate: tokenizing stops there (a text
    that cannot fit is never tokenized whole).
    """
    limit = None if context_length is None else context_length - 1
    try:
        return _plan(chains, req, tok, limit)
    except TooManyTokens as exc:
        assert context_length is not None
        raise ContextOverflow(exc.at_least, context_length, at_least=not exc.exact) from None


def _plan(chains: SessionChains, req: ChatRequest, tok: Tokenizer, limit: int | None) -> TurnPlan:
    match = _best_match(chains, req)
    common = {
        "request_digests": req.message_digests,
        "system_digest": req.system_digest,
        "render_digest": req.render_digest,
        "n_tools": len(req.tools),
        "eos_token_ids": tuple(tok.eos_token_ids),
    }
    if match is None or _another_conversation(chains, match, req):
        return _fresh(chains, req, tok, common, limit)
    plan = _continue(chains, match, req, tok, common, limit)
    if plan is not None:
        return plan
    return _fresh(
        chains,
        req,
        tok,
        common,
        limit,
        fallback=f"chain {match.chain.chain_id} matched but the chat template does not render "
        "new messages independently of earlier ones; rendered the whole conversation instead",
    )


def _another_conversation(chains: SessionChains, match: _Match, req: ChatRequest) -> bool:
    """Does a re-sent first request of a chain start another conversation (not a retry)?

    A side request asked again (a title, a check) is another side request.
    The agent may dispatch the same task twice (in parallel or one after the
    other): the second subagent's first request is byte-identical to the
    first's; while a dispatch of that task waits for its subagent, it starts
    that one (`_fresh` claims it). The same task: the prompt of the dispatch
    the re-sent chain answers, or, not knowing it, a prompt the request
    carries. A dispatch of another task, or of an unknown one (an Agent call
    without a prompt), waiting beside it makes no difference: the request is
    a retry. The reducer follows the decision recorded here (`replay.chains`).
    """
    chain, main = match.chain, chains.main
    if not match.is_retry or match.boundary is not chain.boundaries[0]:
        return False
    if (
        main is not None
        and chain is not main
        and is_side_request(chain.n_tools, chain.system_digest, main.system_digest)
    ):
        return True
    if chain.main_line:
        return False
    task = next(
        (d.prompt.strip() for d in chains.pending_dispatches
         if d.chain_id == chain.chain_id and d.prompt.strip()),
        None,
    )  # fmt: skip
    return any(
        d.prompt.strip() == task if task is not None else _prompt_matches(d, req)
        for d in chains.pending_dispatches
        if d.chain_id is None and d.prompt.strip()
    )


def render_chars(chains: SessionChains, req: ChatRequest, tok: Tokenizer, body_len: int) -> int:
    """About how much text `plan_turn(chains, req, tok)` will render and tokenize.

    Extending a chain renders only the new messages; a request that matches
    no chain (or a template that cannot render new messages on their own)
    renders the whole conversation, about `body_len` characters; a retry
    renders nothing. Cheap: lets the caller plan small work inline and big
    work on a thread, by the work itself rather than the body size.
    """
    match = _best_match(chains, req)
    if (
        match is None
        or _another_conversation(chains, match, req)
        or _template_pieces(tok, req) is None
    ):
        return body_len
    if match.is_retry:
        return 0
    return _text_chars(req.messages[match.n_messages :])


def _text_chars(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_chars(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_text_chars(v) for v in value)
    return 0


def _best_match(chains: SessionChains, req: ChatRequest) -> _Match | None:
    """The chain boundary covering the most of the request (a full extension wins)."""
    digests = req.message_digests
    best: _Match | None = None
    for chain in chains.chains.values():
        if chain.system_digest != req.system_digest or chain.render_digest != req.render_digest:
            continue
        common = _common_prefix(chain.message_digests, digests)
        for boundary in reversed(chain.boundaries):
            out_n = boundary.n_input_messages + 1
            if out_n <= common and len(digests) > out_n:
                candidate = _Match(
                    chain=chain,
                    boundary=boundary,
                    n_messages=out_n,
                    is_end=boundary is chain.boundaries[-1],
                    is_retry=False,
                )
            elif boundary.n_input_messages == len(digests) <= common:
                candidate = _Match(chain, boundary, len(digests), False, True)
            else:
                continue
            if best is None or (candidate.is_end, candidate.n_messages) > (
                best.is_end,
                best.n_messages,
            ):
                best = candidate
            break
    return best


def _common_prefix(ours: Sequence[str], echoed: Sequence[str]) -> int:
    """How many leading messages of a request match the chain's (see `same_message`)."""
    n = min(len(ours), len(echoed))
    if all(map(operator.eq, ours, echoed)):
        return n  # the usual case, compared at C speed: every digest the same
    for i in range(n):
        if ours[i] != echoed[i] and not same_message(ours[i], echoed[i]):
            return i
    return n


def _continue(
    chains: SessionChains,
    match: _Match,
    req: ChatRequest,
    tok: Tokenizer,
    common: dict[str, Any],
    limit: int | None,
) -> TurnPlan | None:
    """Input = the chain's exact tokens up to the boundary + only the new messages."""
    chain, boundary = match.chain, match.boundary
    returned = _returned_dispatches(chains, req)
    if match.is_retry:
        return TurnPlan(
            chain_id=_reserve_id(chains),
            action="new",
            reason="diverged",
            parent_chain_id=chain.chain_id,
            input_ids=chain.tokens[: boundary.input_len],
            prefix_len=boundary.input_len,
            new_messages=0,
            main_line=chain.main_line,
            returned_dispatch_ids=returned,
            **common,
        )
    pieces = _template_pieces(tok, req)
    if pieces is None:
        return None
    close_text, head = pieces
    new_messages = req.messages[match.n_messages :]
    # The render holds `head` (not part of the input) before the new messages:
    # its tokens are allowed on top of the room the chain's tokens leave.
    head_tokens = 0 if limit is None else -(-len(head) // tok.max_token_chars)
    room = None if limit is None else limit - boundary.end_len + head_tokens
    try:
        full = _render(
            tok, room, [*_PREFIX_MESSAGES, *new_messages], req.tools, req.template_kwargs
        )
    except TooManyTokens as exc:
        at_least = exc.at_least - head_tokens + boundary.end_len
        raise TooManyTokens(at_least, exc.limit, exact=False) from None
    if not full.startswith(head):
        return None
    glue_text, closing = _glue(tok, chain.tokens, boundary, close_text)
    glue_ids = tok.encode(closing) if closing else []
    input_ids = chain.tokens[: boundary.end_len]
    input_ids.extend(glue_ids)
    room = None if limit is None else limit - len(input_ids)
    try:
        input_ids.extend(_encode(tok, glue_text + full[len(head) :], room))
    except TooManyTokens as exc:
        raise TooManyTokens(exc.at_least + len(input_ids), exc.limit, exact=exc.exact) from None
    extend = match.is_end
    summary = not extend and _drops_only_last_answer(chain, req)
    return TurnPlan(
        chain_id=chain.chain_id if extend else _reserve_id(chains),
        action="extend" if extend else "new",
        reason="extends" if extend else "compaction" if summary else "diverged",
        parent_chain_id=None if extend else chain.chain_id,
        input_ids=input_ids,
        prefix_len=boundary.end_len,
        new_messages=len(new_messages),
        closing_inserted=len(glue_ids),
        main_line=chain.main_line,
        dispatch_tool_use_id=chain.dispatch_tool_use_id if summary else None,
        returned_dispatch_ids=returned,
        **common,
    )


def _drops_only_last_answer(chain: Chain, req: ChatRequest) -> bool:
    """Does `req` re-send all of the chain's last input, then user text, without its answer?

    Claude Code's compaction right after a tool result does this: the summary
    request appends its instruction to the tool results and leaves out the
    last answer. That answer was received and acted on, so the request is a
    new chain beside the old one (reason "compaction"), not a fork of it:
    the old chain keeps its last turn. The reducer recognises the same shape
    from the recorded facts (`replay.chains`): same trailing tool results,
    more chat messages, tokens shared up to the last turn.
    """
    last = chain.boundaries[-1]
    n = last.n_input_messages
    return (
        bool(req.tool_result_ids)
        and len(req.message_digests) > n
        and _common_prefix(chain.message_digests, req.message_digests) >= n
        and all(m["role"] == "user" for m in req.messages[n:])
    )


def _template_pieces(tok: Tokenizer, req: ChatRequest) -> tuple[str, str] | None:
    """(text closing an assistant turn, render of the fixed prefix), from the template itself.

    Cached per tokenizer and render digest (tools + template kwargs).
    """
    try:
        cache = _PIECES.setdefault(tok, {})
    except TypeError:  # a tokenizer that cannot be weakly referenced
        cache = {}
    key = req.render_digest + repr(sorted(req.template_kwargs.items()))
    cached = cache.get(key, _MISSING)  # one lookup: safe when sessions plan in threads
    if cached is not _MISSING:
        return cached  # type: ignore[return-value]
    head = tok.render(list(_PREFIX_MESSAGES), req.tools or None, False, **req.template_kwargs)
    at = head.rfind(_SENTINEL)
    pieces = None if at < 0 else (head[at + len(_SENTINEL) :], head)
    if len(head) > _MAX_CACHED_HEAD:
        return pieces  # rendered anew each time: 64 of these would be gigabytes
    if len(cache) >= 64:
        cache.clear()
    cache[key] = pieces
    return pieces


def _glue(tok: Tokenizer, tokens: array, boundary: Boundary, close_text: str) -> tuple[str, str]:
    """(glue text after an output that ended with EOS, closing text to insert otherwise).

    After EOS the template's closing minus the EOS text remains (ChatML: "\\n").
    Without EOS (max_tokens, stop sequence) the whole closing is inserted.
    """
    if boundary.ended_with_eos:
        eos_text = tok.decode([tokens[boundary.end_len - 1]])
        if close_text.startswith(eos_text):
            return close_text[len(eos_text) :], ""
    return "", close_text


def _fresh(
    chains: SessionChains,
    req: ChatRequest,
    tok: Tokenizer,
    common: dict[str, Any],
    limit: int | None,
    fallback: str = "",
) -> TurnPlan:
    """A new chain from a full render, classified by how it relates to the main line."""
    text = _render(tok, limit, req.messages, req.tools, req.template_kwargs)
    input_ids = _encode(tok, text, limit)
    del text
    main = chains.main
    if main is not None and takes_main_line(
        len(req.tools),
        req.system_digest,
        len(input_ids),
        main.n_tools,
        main.system_digest,
        main.boundaries[-1].input_len if main.boundaries else 0,
    ):
        main = None  # the session began with a side request: this is its real main line
    dispatch = _dispatch_for(chains, req)
    reason: Reason
    if main is None:
        reason, main_line = "first", True
    elif is_side_request(len(req.tools), req.system_digest, main.system_digest):
        reason, main_line, dispatch = "side", False, None
    elif dispatch is not None and (
        req.system_digest != main.system_digest or _prompt_matches(dispatch, req)
    ):
        reason, main_line = "subagent", False
    elif req.system_digest == main.system_digest:
        reason, main_line = "compaction", True
    else:
        reason, main_line = "diverged", False
    return TurnPlan(
        chain_id=_reserve_id(chains),
        action="new",
        reason=reason,
        parent_chain_id=main.chain_id if reason in ("compaction", "subagent") else None,
        fallback=fallback,
        input_ids=input_ids,
        prefix_len=0,
        new_messages=len(req.messages),
        dispatch_tool_use_id=dispatch.tool_use_id if reason == "subagent" else None,
        main_line=main_line,
        returned_dispatch_ids=_returned_dispatches(chains, req),
        **common,
    )


def is_side_request(n_tools: int, system_digest: str, main_system_digest: str) -> bool:
    """A title, topic or classification request beside the agent's conversation?

    It offers no tools and has a system prompt of its own (not the main
    line's). The reducer applies the same test to recorded facts
    (`replay.chains`).
    """
    return n_tools == 0 and system_digest != main_system_digest


def takes_main_line(
    n_tools: int,
    system_digest: str,
    input_len: int,
    main_n_tools: int,
    main_system_digest: str,
    main_input_len: int,
) -> bool:
    """Does a new conversation take the main line from the one that held it so far?

    The main line is the conversation that carries the session's work, not
    simply the first system prompt: a side request (a title, sent first) may
    come before it. So a request with a system prompt of its own takes the
    main line from a main line that offered no tools when it offers tools,
    or, when neither does (`claude --tools ""`), when its input is longer
    than the main line's latest input (a side request's prompt is short and
    its own; the agent's carries its instructions and its work). The
    earlier line is then a side request, never `final`. The reducer applies
    the same test to recorded facts (`replay.chains.main_system_digest`).
    """
    if main_n_tools != 0 or system_digest == main_system_digest:
        return False
    return n_tools > 0 or input_len > main_input_len


def _dispatch_for(chains: SessionChains, req: ChatRequest) -> PendingDispatch | None:
    """The pending dispatch whose prompt this request carries (the longest: one task's
    prompt may hold another's), else the oldest pending one."""
    waiting = [d for d in chains.pending_dispatches if d.chain_id is None]
    if not waiting:
        return None
    matching = [d for d in waiting if _prompt_matches(d, req)]
    if matching:
        return max(matching, key=lambda d: len(d.prompt.strip()))  # the first of the longest
    return waiting[0]


def _prompt_matches(dispatch: PendingDispatch, req: ChatRequest) -> bool:
    prompt = dispatch.prompt.strip()
    if not prompt:
        return False
    first_user = next((m for m in req.messages if m["role"] == "user"), None)
    return first_user is not None and prompt in first_user["content"]


def _returned_dispatches(chains: SessionChains, req: ChatRequest) -> tuple[str, ...]:
    """Pending dispatches whose tool_result this request carries (the subagent returned)."""
    if not req.tool_result_ids:
        return ()
    ids = set(req.tool_result_ids)
    return tuple(d.tool_use_id for d in chains.pending_dispatches if d.tool_use_id in ids)


def _reserve_id(chains: SessionChains) -> int:
    chain_id = chains.next_chain_id
    chains.next_chain_id += 1
    return chain_id


# --------------------------------------------------------------------------
# Committing
# --------------------------------------------------------------------------


def commit_turn(
    chains: SessionChains,
    plan: TurnPlan,
    output_ids: Sequence[int],
    assistant_message_digest: str,
) -> Chain:
    """Record the engine's answer: chain tokens = input_ids + output_ids.

    `assistant_message_digest` is `translate.response_message_digest(content)`
    of the answer sent to the client, which it will echo back next turn.
    """
    ended_with_eos = bool(output_ids) and output_ids[-1] in plan.eos_token_ids
    boundary = Boundary(
        n_input_messages=len(plan.request_digests),
        input_len=len(plan.input_ids),
        end_len=len(plan.input_ids) + len(output_ids),
        ended_with_eos=ended_with_eos,
    )
    digests = [*plan.request_digests, assistant_message_digest]
    chains.clock += 1
    if plan.action == "extend":
        chain = chains.chains[plan.chain_id]
        if len(chain.tokens) != plan.prefix_len:
            raise RuntimeError(
                f"chain {plan.chain_id} changed between plan_turn and commit_turn; "
                "plan and commit one turn at a time per session (hold the session lock)"
            )
        chain.tokens.extend(plan.input_ids[plan.prefix_len :])
        chain.tokens.extend(output_ids)
        chain.message_digests = digests
        chain.boundaries.append(boundary)
    else:
        parent = (
            chains.chains.get(plan.parent_chain_id) if plan.parent_chain_id is not None else None
        )
        inherited = parent.boundaries if parent is not None and plan.prefix_len else []
        chain = Chain(
            chain_id=plan.chain_id,
            system_digest=plan.system_digest,
            render_digest=plan.render_digest,
            message_digests=digests,
            tokens=plan.input_ids[:],
            boundaries=[b for b in inherited if b.end_len <= plan.prefix_len] + [boundary],
            main_line=plan.main_line,
            n_tools=plan.n_tools,
            parent_chain_id=plan.parent_chain_id,
            dispatch_tool_use_id=plan.dispatch_tool_use_id
            or (parent.dispatch_tool_use_id if parent is not None else None),
        )
        chain.tokens.extend(output_ids)
        chains.chains[chain.chain_id] = chain
        if plan.main_line:
            chains.main_chain_id = chain.chain_id
    chain.last_used = chains.clock
    _settle_dispatches(chains, plan)
    _evict(chains)
    return chain


def _settle_dispatches(chains: SessionChains, plan: TurnPlan) -> None:
    """A subagent chain claims its dispatch; a tool_result on the main line ends it."""
    done = set(plan.returned_dispatch_ids)
    started = plan.dispatch_tool_use_id if plan.reason == "subagent" else None
    kept: list[PendingDispatch] = []
    for d in chains.pending_dispatches:
        if d.tool_use_id == started:
            if not d.returned:
                kept.append(msgspec.structs.replace(d, chain_id=plan.chain_id))
        elif d.tool_use_id not in done:
            kept.append(d)
        elif d.chain_id is None:  # a background agent: its subagent has not started yet
            kept.append(msgspec.structs.replace(d, returned=True))
    chains.pending_dispatches = kept


def _evict(chains: SessionChains) -> None:
    while len(chains.chains) > max(1, chains.max_chains):
        victims = [c for c in chains.chains.values() if c.chain_id != chains.main_chain_id]
        oldest = min(victims, key=lambda c: c.last_used)
        del chains.chains[oldest.chain_id]


def note_dispatch(
    chains: SessionChains,
    tool_use_ids: Sequence[str],
    prompts: Sequence[str | None] | None = None,
) -> None:
    """Remember Agent/Task dispatches from a response (see `translate.find_dispatches`).

    A later request with a different system prompt (or carrying a dispatch's
    prompt) starts that dispatch's subagent chain.
    """
    known = {d.tool_use_id for d in chains.pending_dispatches}
    for i, tool_use_id in enumerate(tool_use_ids):
        if tool_use_id in known:
            continue
        prompt = (prompts[i] if prompts is not None and i < len(prompts) else None) or ""
        chains.pending_dispatches.append(PendingDispatch(tool_use_id, prompt))
        known.add(tool_use_id)
    # A dispatch whose result never comes back must not pile up forever.
    del chains.pending_dispatches[:-MAX_PENDING_DISPATCHES]


# --------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------


def tito_check(tok: Tokenizer, output_ids: Sequence[int]) -> TitoResult:
    """Does decode -> re-encode give back the model's exact output ids?"""
    ids = list(output_ids)
    reencoded = tok.encode(tok.decode(ids))
    if reencoded == ids:
        return TitoResult(ok=True, first_divergence=None, reencoded_ids=reencoded)
    first = next((i for i, (a, b) in enumerate(zip(ids, reencoded, strict=False)) if a != b), None)
    return TitoResult(
        ok=False,
        first_divergence=min(len(ids), len(reencoded)) if first is None else first,
        reencoded_ids=reencoded,
    )


def clamp_max_new_tokens(requested: int | None, input_len: int, context_length: int) -> int:
    """max_new_tokens that fits: prompt + output must stay within the context length."""
    room = context_length - input_len
    if room < 1:
        raise ContextOverflow(input_len, context_length)
    return room if requested is None else max(1, min(requested, room))


def token_array(ids: Sequence[int]) -> array:
    """Token ids as the int32 `array` chains and plans hold (numpy arrays: one copy)."""
    tobytes = getattr(ids, "tobytes", None)
    if isinstance(ids, array) or tobytes is None:
        return array("i", ids)
    out = array("i")
    out.frombytes(np.asarray(ids, dtype=np.int32).tobytes())
    return out


def full_input_ids(req: ChatRequest, tok: Tokenizer) -> list[int]:
    """The request rendered and tokenized from scratch (count_tokens; the no-chain baseline)."""
    return tok.encode(_render_all(req, tok))


def count_input_tokens(req: ChatRequest, tok: Tokenizer) -> int:
    """`len(full_input_ids(req, tok))`, tokenized in bounded pieces (no list of ids)."""
    return len(_encode(tok, _render_all(req, tok), None))


def _render(
    tok: Tokenizer,
    limit: int | None,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    template_kwargs: dict[str, Any],
) -> str:
    """`tok.render_within(limit, ...)`; a tokenizer without it (a test's wrapper) renders
    whole when no limit is asked."""
    if limit is None and not hasattr(tok, "render_within"):
        return tok.render(messages, tools or None, True, **template_kwargs)
    return tok.render_within(limit, messages, tools or None, True, **template_kwargs)


def _encode(tok: Tokenizer, text: str, limit: int | None) -> array:
    """`tok.encode_array(text, limit)`, or `encode` for a tokenizer without it and no limit."""
    if limit is None and not hasattr(tok, "encode_array"):
        return token_array(tok.encode(text))
    return tok.encode_array(text, limit)


def _render_all(req: ChatRequest, tok: Tokenizer) -> str:
    return tok.render(req.messages, req.tools or None, True, **req.template_kwargs)
