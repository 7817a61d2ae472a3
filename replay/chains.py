"""Chains: turns linked by exact token-prefix extension, classified by line.

A turn whose input extends no chain but repeats a chain's first turns (a
retried request, an edited message, a compaction summary that re-sends the
head of the conversation) forks that chain: the fork inherits the turns
before the divergence, so they are trained once, in the branch the
conversation went on with.

An answer the client went on to act on is trained, whatever branch it sits
in. Evidence of acting on it, all from recorded facts: a later turn of its
own chain (whose input carries the answer), a later request answering one
of its tool calls, or a later request that carries the answer itself
(`MessagesRequest.answer_keys`: the turns Claude Code keeps verbatim after
a partial compaction's summary, the text a client echoes without). A branch
the conversation left after such answers is closed into a segment of its
line's kind (a main-line branch is a `wipe`) holding its turns up to the
last acted-on one; the turns it shares with a branch trained before it are
masked there (`Chain.trained_elsewhere`). Only the turns no later request
shows the client ever used (a retry after a timeout, a regenerate) are an
abandoned branch and yield no segment (seed 004: divergence is not a
segment kind). Compaction that shares no turn leaves the chain before it a
`wipe` segment.

Part of the pure reducer (see `replay.reducer` for the rules it implements).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from recorder.dialects.chat import echo_keys
from recorder.dialects.translate import response_message_digest
from recorder.model.tokens import is_side_request, takes_main_line
from replay.rules import Rules
from replay.samples import SegmentKind
from replay.turns import Turn

Line = Literal["main", "subagent", "nested", "orphan", "side"]


@dataclass(slots=True, eq=False)
class Chain:
    chain_id: int
    line: Line
    system_digest: str | None
    turns: list[Turn] = field(default_factory=list)
    dispatch_id: str | None = None
    owner: Chain | None = None
    nested_dropped_turns: int = 0
    forked_from: Chain | None = None  # the branch this one diverged from
    # Leading turns trained in another segment (shared with the branch the
    # conversation went on with): context here, masked.
    trained_elsewhere: int = 0

    @property
    def root(self) -> Chain:
        """The first chain of this one's fork tree."""
        chain = self
        while chain.forked_from is not None:
            chain = chain.forked_from
        return chain

    @property
    def last_seq(self) -> int:
        return max(self.turns[-1].seqs)

    @property
    def seq_tokens(self) -> np.ndarray:
        """The chain's full sequence: its last turn's input + output.

        Built only where a whole sequence is compared (a fork); extending
        compares the two parts in place (`_extends`), so a turn does not copy
        the whole context again."""
        last = self.turns[-1]
        assert last.input is not None and last.output is not None
        return np.concatenate([last.input, last.output])

    @property
    def seq_size(self) -> int:
        last = self.turns[-1]
        assert last.input is not None and last.output is not None
        return int(last.input.size + last.output.size)

    def extend(self, t: Turn) -> None:
        assert t.input is not None and t.output is not None
        self.turns.append(t)


@dataclass(slots=True, eq=False)
class Dispatch:
    """A main-line dispatch still waiting for its subagent or its tool_result.

    `returned`: its tool_result came back before any chain claimed it (a
    background agent: "Async agent launched"); the next subagent chain does,
    then the dispatch is done.
    """

    tool_use_id: str
    chains: list[Chain] = field(default_factory=list)
    returned: bool = False


def _shared_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two token arrays."""
    n = min(a.size, b.size)
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def _extends(inp: np.ndarray, c: Chain) -> bool:
    """Does `inp` start with `c`'s full sequence (its last input + output)?"""
    last = c.turns[-1]
    assert last.input is not None and last.output is not None
    head, tail = last.input, last.output
    k = head.size
    n = k + tail.size
    if not 0 < n <= inp.size:
        return False
    first = head[0] if k else tail[0]
    final = tail[-1] if tail.size else head[-1]
    return (
        inp[0] == first
        and inp[n - 1] == final
        and bool((inp[:k] == head).all())
        and bool((inp[k:n] == tail).all())
    )


def _drops_only_last_answer(t: Turn, c: Chain, kept: int) -> bool:
    """Does `t` re-send all of `c`'s last turn but its answer, then more user text?

    Recognised from facts: `t` diverges from `c` within its last turn's input,
    carries the same trailing tool results and more chat messages. The live
    planner's twin is `recorder.model.tokens._drops_only_last_answer`; v1 logs
    (no message counts) never match.
    """
    last = c.turns[-1]
    if kept != len(c.turns) - 1 or t.request is None or last.request is None:
        return False
    ours, theirs = t.request, last.request
    return (
        bool(ours.tool_result_ids)
        and ours.tool_result_ids == theirs.tool_result_ids
        and ours.n_chat_messages is not None
        and theirs.n_chat_messages is not None
        and ours.n_chat_messages > theirs.n_chat_messages
    )


def _is_side(t: Turn, main_digest: str | None) -> bool:
    """A title or classification request: no tools and its own system prompt.

    v1 logs did not record the tool count: never side.
    """
    r = t.request
    if r is None or r.n_tools is None or main_digest is None:
        return False
    return is_side_request(r.n_tools, r.system_digest, main_digest)


def main_system_digest(turns: Sequence[Turn]) -> str | None:
    """The main line's system digest: the line that carries the session's work.

    The first request offering tools has it (a title request without tools
    may have come first). When no request offers tools, the lines take it
    from each other as the live planner does (`recorder.model.tokens.takes_main_line`):
    a new conversation with another system prompt takes it when its input is
    longer than the main line's latest input.
    """
    for t in turns:
        if t.request is not None and t.request.n_tools != 0:
            return t.system_digest
    digest: str | None = None
    latest = 0
    for t in turns:
        if t.request is None:
            continue
        if digest is None:
            digest = t.system_digest
        if t.rendered is None or t.response is None:
            continue  # no answer: the live chains never saw it
        size = t.rendered.input_ids.length
        if t.system_digest == digest:
            latest = size
        elif _fresh(t) and takes_main_line(0, t.system_digest or "", size, 0, digest or "", latest):
            digest, latest = t.system_digest, size
    return digest


def _fresh(t: Turn) -> bool:
    """Was the turn's input rendered whole (it extended no chain)?"""
    return t.rendered is not None and t.rendered.prefix_len == 0


@dataclass(slots=True)
class Evidence:
    """What later requests show the client kept: the latest seq that showed each.

    `tool_results`: tool_use id -> seq of the last request answering it;
    `answers`: message key (`translate.message_key`) -> seq of the last
    request carrying that assistant message.
    """

    tool_results: dict[str, int] = field(default_factory=dict)
    answers: dict[str, int] = field(default_factory=dict)

    def note(self, t: Turn) -> None:
        r = t.request
        if r is None:
            return
        for tid in r.tool_result_ids:
            self.tool_results[tid] = t.first_seq
        for key in r.answer_keys or ():
            self.answers[key] = t.first_seq

    def acted_on(self, t: Turn) -> bool:
        """Did a request after `t` answer one of its tool calls or carry its answer?"""
        if t.response is None:
            return False
        if any(self.tool_results.get(i, -1) > t.first_seq for i in _tool_use_ids(t)):
            return True
        if not self.answers:
            return False
        return any(self.answers.get(k, -1) > t.first_seq for k in _answer_keys(t))


def _tool_use_ids(t: Turn) -> list[str]:
    """The ids of the tool calls `t` answered with."""
    content = t.response.content if t.response is not None else []
    return [
        str(b.get("id")) for b in content if isinstance(b, dict) and b.get("type") == "tool_use"
    ]


def _answer_keys(t: Turn) -> tuple[str, ...]:
    """The keys a request carrying `t`'s answer as an assistant message has for it."""
    if t.response is None:
        return ()
    try:
        return tuple(echo_keys(response_message_digest(t.response.content)))
    except ValueError:  # content that is no Anthropic blocks: no message to find
        return ()


def _twins(a: Turn, b: Turn) -> bool:
    """Same engine input and output, token for token (a request re-sent and answered alike)."""
    if a.input is None or b.input is None or a.output is None or b.output is None:
        return False
    return (
        a.input.size == b.input.size
        and a.output.size == b.output.size
        and bool(np.array_equal(a.output, b.output))
        and bool(np.array_equal(a.input, b.input))
    )


def _carries(t: Turn, answer: Turn) -> bool:
    """Does `t`'s request answer one of `answer`'s tool calls or carry its message?"""
    r = t.request
    if r is None:
        return False
    if set(r.tool_result_ids) & set(_tool_use_ids(answer)):
        return True
    return bool(set(r.answer_keys or ()) & set(_answer_keys(answer)))


class ChainBuilder:
    """Walks turns in order, assigning each usable one to a chain."""

    def __init__(self, rules: Rules, diags: list[str], main_digest: str | None = None) -> None:
        self.rules = rules
        self.diags = diags
        self.chains: list[Chain] = []
        self.main_digest: str | None = main_digest
        self.main_pending: dict[str, Dispatch] = {}
        self.nested_pending: dict[str, Chain] = {}
        self.last_main: Chain | None = None
        self.evidence = Evidence()
        self.turn_of_call: dict[str, Turn] = {}  # tool_use id -> the turn that answered it
        self.foreign_calls_noted = False

    def add(self, t: Turn) -> None:
        if self.main_digest is None and t.system_digest is not None:
            self.main_digest = t.system_digest
        self.evidence.note(t)
        self._returns(t)
        self._note_foreign_calls(t)
        chain = self._assign(t) if t.unusable is None else None
        self._dispatches(t, chain)
        for call in _tool_use_ids(t):
            self.turn_of_call.setdefault(call, t)

    def _note_foreign_calls(self, t: Turn) -> None:
        """Say once when a request answers tool calls only under ids none of this session's
        answers had, though the session has answered with calls: a client that rewrites
        call ids cannot be followed, and its answers end up abandoned (`replay stats`:
        "in no segment") without any other sign."""
        r = t.request
        if self.foreign_calls_noted or r is None or not r.tool_result_ids or not self.turn_of_call:
            return
        if any(i in self.turn_of_call for i in r.tool_result_ids):
            return
        self.foreign_calls_noted = True
        self.diags.append(
            f"turn {t.turn}: the request answers tool calls under ids no answer of this "
            f"session carried ({', '.join(sorted(r.tool_result_ids)[:3])}): a client that "
            "rewrites tool-call ids cannot be followed by id; wherever the history it sends "
            "is not the model's tokens, its answers count as abandoned"
        )

    def _is_main_system(self, digest: str | None) -> bool:
        return digest is None or self.main_digest is None or digest == self.main_digest

    def _returns(self, t: Turn) -> None:
        if t.request is None:
            return
        for tid in t.request.tool_result_ids:
            pending = self.main_pending.get(tid)
            if pending is not None and self._is_main_system(t.system_digest):
                if pending.chains:
                    del self.main_pending[tid]
                else:
                    pending.returned = True
            self.nested_pending.pop(tid, None)

    def _assign(self, t: Turn) -> Chain:
        assert t.input is not None
        best = self._extended(t)
        if best is not None:
            best.extend(t)
            self._note_decision(t, "extend", best)
        else:
            fork = self._fork_point(t)
            if fork is None or self._another_conversation(t, *fork):
                best = self._new_chain(t)
            elif _drops_only_last_answer(t, *fork):
                best = self._fork(t, fork[0], 0, beside=True)
            else:
                best = self._fork(t, *fork)
            self._note_decision(t, "new", best)
        if best.line == "main":
            self.last_main = best
        elif best.line == "nested" and best.owner is not None:
            best.owner.nested_dropped_turns += 1
        return best

    def _extended(self, t: Turn) -> Chain | None:
        """The longest chain `t` extends. Chains of equal length hold the same tokens
        (a request re-sent and answered alike): the one whose answer `t`'s request
        carries (its tool results, its message), else the latest."""
        assert t.input is not None
        best: Chain | None = None
        for c in self.chains:
            if not _extends(t.input, c) or (best is not None and c.seq_size < best.seq_size):
                continue
            if self._carries_a_twin_instead(t, c):
                continue
            if best is None or c.seq_size > best.seq_size or not _carries(t, best.turns[-1]):
                best = c
        return best

    def _carries_a_twin_instead(self, t: Turn, c: Chain) -> bool:
        """Does `t`'s request carry the answer of a twin of `c`'s last turn (same input,
        same output), not that turn's own? Then `c` holds only the repeat the client did
        not use, and `t` is no extension of it: a later request that extends no chain the
        client kept (a retry, a compaction) must not land on the repeat."""
        r = t.request
        if r is None or not (r.tool_result_ids or r.answer_keys):
            return False
        last = c.turns[-1]
        if _carries(t, last):
            return False
        carried = {self.turn_of_call.get(i) for i in r.tool_result_ids}
        if r.answer_keys:
            keys = set(r.answer_keys)
            carried.update(u for ch in self.chains for u in ch.turns if keys & set(_answer_keys(u)))
        return any(u is not None and u is not last and _twins(u, last) for u in carried)

    def _fork_point(self, t: Turn) -> tuple[Chain, int] | None:
        """(chain, turns it shares with `t`) if `t` re-sends at least its first input.

        A chain's turns are prefixes of its tokens, so one compare finds how
        far `t` follows it; the branch followed furthest wins.
        """
        assert t.input is not None
        best: tuple[Chain, int] | None = None
        best_len = -1
        for c in self.chains:
            if c.turns[0].input is None or c.turns[0].input.size > t.input.size:
                continue
            shared = _shared_len(t.input, c.seq_tokens)
            if shared < c.turns[0].input.size or shared <= best_len:
                continue
            kept = sum(1 for u in c.turns if u.input.size + u.output.size <= shared)  # type: ignore[union-attr]
            best, best_len = (c, kept), shared
        return best

    def _fork(self, t: Turn, parent: Chain, kept: int, *, beside: bool = False) -> Chain:
        """A new branch of `parent`: its first `kept` turns, then `t`.

        `beside`: a chain on `parent`'s line that is no branch of it (a
        compaction summary that left out the last answer): both yield segments.
        """
        assert t.input is not None and t.output is not None
        chain = Chain(
            chain_id=len(self.chains),
            line=parent.line,
            system_digest=parent.system_digest,
            turns=[*parent.turns[:kept], t],
            dispatch_id=parent.dispatch_id,
            owner=parent.owner,
            forked_from=None if beside else parent,
        )
        self.chains.append(chain)
        pending = self.main_pending.get(chain.dispatch_id or "")
        if chain.line == "subagent" and pending is not None:
            pending.chains.append(chain)
        return chain

    def _new_chain(self, t: Turn) -> Chain:
        assert t.input is not None and t.output is not None
        line: Line
        dispatch: str | None = None
        owner: Chain | None = None
        sysd = t.system_digest
        claimed = self._claimed_by_live_decision(t)
        if _is_side(t, self.main_digest):
            line = "side"
        elif claimed is not None:
            line = "subagent"
            dispatch = claimed.tool_use_id
        elif self._is_main_system(sysd):
            line = "main"
        elif self.nested_pending:
            line = "nested"
            # Attribute to the subagent that dispatched (the oldest pending).
            owner = next(iter(self.nested_pending.values()))
            while owner.owner is not None:
                owner = owner.owner
            dispatch = owner.dispatch_id
            self.diags.append(
                f"turn {t.turn}: chain started while a nested subagent dispatch is pending: "
                "its turns are dropped (nested subagents are not segmented)"
            )
        else:
            target = self._pick_dispatch(sysd)
            if target is not None:
                line = "subagent"
                dispatch = target.tool_use_id
            elif self.rules.orphan_chains == "main":
                line = "main"
                self.diags.append(
                    f"turn {t.turn}: foreign system prompt with no pending dispatch: "
                    "treated as main line"
                )
            else:
                line = "orphan"
                self.diags.append(
                    f"turn {t.turn}: foreign system prompt with no pending dispatch: dropped"
                )
        chain = Chain(
            chain_id=len(self.chains),
            line=line,
            system_digest=sysd,
            turns=[t],
            dispatch_id=dispatch,
            owner=owner,
        )
        self.chains.append(chain)
        if line == "subagent":
            claimed = self.main_pending[dispatch]  # type: ignore[index]
            claimed.chains.append(chain)
            if claimed.returned:
                del self.main_pending[claimed.tool_use_id]
        return chain

    def _another_conversation(self, t: Turn, c: Chain, kept: int) -> bool:
        """Does `t`, re-sending the first request of `c`, start another conversation?

        A side request asked again (a title, a check) is another side request;
        a subagent's first request re-sent while a dispatch waits for its
        subagent is the same task dispatched again, if the recorder linked it
        to a dispatch: it matched the dispatch's prompt, which the reducer
        cannot see (a retry while another task's dispatch waits is no new
        task). Without a recorded decision, any waiting dispatch counts.
        Otherwise it is a retry (the live planner's twin:
        `recorder.model.tokens._another_conversation`).
        """
        first = c.turns[0].input
        if not (
            kept == 0
            and c.forked_from is None
            and first is not None
            and t.input is not None
            and bool(np.array_equal(t.input, first))
        ):
            return False
        if c.line == "side":
            return True
        if c.line != "subagent" or not any(not d.chains for d in self.main_pending.values()):
            return False
        d = t.decision
        return d is None or (d.reason == "subagent" and bool(d.dispatch_tool_use_id))

    def _claimed_by_live_decision(self, t: Turn) -> Dispatch | None:
        """The waiting dispatch the recorder linked `t`'s new chain to, if any.

        The recorder matched the dispatch's prompt in the request body, which
        the reducer does not read: that tells apart a subagent sharing the
        main system prompt from the main line, and labels parallel subagents
        whose first requests come in another order than their dispatches.
        Without such a decision (or while a nested dispatch is pending) the
        oldest waiting dispatch is taken (`_pick_dispatch`).
        """
        d = t.decision
        if d is None or d.reason != "subagent" or not d.dispatch_tool_use_id:
            return None
        if self.nested_pending and not self._is_main_system(t.system_digest):
            return None
        pending = self.main_pending.get(d.dispatch_tool_use_id)
        return pending if pending is not None and not pending.chains else None

    def _pick_dispatch(self, sysd: str | None) -> Dispatch | None:
        for d in self.main_pending.values():
            if not d.chains:
                return d
        for d in reversed(self.main_pending.values()):
            if any(c.system_digest == sysd for c in d.chains):
                return d
        return None

    def _dispatches(self, t: Turn, chain: Chain | None) -> None:
        if t.response is None:
            return
        ids = [
            str(b.get("id"))
            for b in t.response.content
            if isinstance(b, dict)
            and b.get("type") == "tool_use"
            and b.get("name") in self.rules.dispatch_tool_names
            and b.get("id")
        ]
        if not ids:
            return
        main = chain.line == "main" if chain is not None else self._is_main_system(t.system_digest)
        for tid in ids:
            if main:
                self.main_pending.setdefault(tid, Dispatch(tid))
            elif chain is not None and chain.line in ("subagent", "nested"):
                self.nested_pending.setdefault(tid, chain)
            else:
                self.diags.append(f"turn {t.turn}: dispatch {tid} from an unknown line ignored")

    def _note_decision(self, t: Turn, action: str, chain: Chain) -> None:
        d = t.decision
        if d is not None and d.action != action:
            self.diags.append(
                f"turn {t.turn}: live decision was {d.action!r} ({d.reason}), "
                f"replay found {action!r} (chain {chain.chain_id})"
            )


def classify_chains(
    chains: list[Chain],
    last_main: Chain | None,
    diags: list[str] | None = None,
    evidence: Evidence | None = None,
) -> list[tuple[SegmentKind, Chain]]:
    """(segment kind, chain) per chain that yields a segment, final last.

    Of each fork tree the branch the conversation went on with trains all its
    turns: the last main chain if the tree holds it, else the branch extended
    last. Every other branch yields a segment of its acted-on turns not
    trained yet (see the module docstring), the rest is abandoned.
    """
    live = _live_branches(chains, last_main)
    owner: dict[int, Chain] = {id(t): c for c in live.values() for t in c.turns}
    out: list[tuple[SegmentKind, Chain]] = []
    for c in chains:
        branch = live[c.root]
        if c is not branch:
            kept = _acted_on_part(c, owner, evidence or Evidence())
            if kept is not None and c.line in ("main", "subagent", "side"):
                for t in kept.turns[kept.trained_elsewhere :]:
                    owner[id(t)] = kept
                out.append(("wipe" if c.line == "main" else c.line, kept))  # type: ignore[arg-type]
            if diags is not None and c.line in ("main", "subagent"):
                diags.extend(_left_branch(c, branch, kept, owner))
        elif c.line in ("subagent", "side"):
            out.append((c.line, c))
        elif c.line == "main":
            out.append(("final" if c is last_main else "wipe", c))
    out.sort(key=lambda kc: (kc[0] == "final", kc[1].last_seq, kc[1].chain_id))
    return out


def _acted_on_part(c: Chain, owner: dict[int, Chain], evidence: Evidence) -> Chain | None:
    """`c` up to its last acted-on turn, if that holds a turn no segment trains yet.

    Every turn but the last was acted on: the next turn's input carries it.
    """
    end = len(c.turns) if evidence.acted_on(c.turns[-1]) else len(c.turns) - 1
    shared = 0
    while shared < end and id(c.turns[shared]) in owner:
        shared += 1
    if shared >= end:
        return None
    last = c.turns[end - 1]
    assert last.input is not None and last.output is not None
    return Chain(
        chain_id=c.chain_id,
        line=c.line,
        system_digest=c.system_digest,
        turns=c.turns[:end],
        dispatch_id=c.dispatch_id,
        owner=c.owner,
        nested_dropped_turns=c.nested_dropped_turns,
        forked_from=c.forked_from,
        trained_elsewhere=shared,
    )


def _live_branches(chains: list[Chain], last_main: Chain | None) -> dict[Chain, Chain]:
    """root -> the one branch of its fork tree that the conversation went on with."""
    live: dict[Chain, Chain] = {}
    for c in chains:
        current = live.get(c.root)
        if current is None or (
            current is not last_main and (c is last_main or c.last_seq > current.last_seq)
        ):
            live[c.root] = c
    return live


def _left_branch(c: Chain, live: Chain, kept: Chain | None, owner: dict[int, Chain]) -> list[str]:
    """What became of the turns of `c`, a branch the conversation left for `live`."""
    out = []
    if kept is not None:
        out.append(
            f"chain {c.chain_id}: left for chain {live.chain_id} after answers the client "
            f"acted on: turns {[t.turn for t in kept.turns[kept.trained_elsewhere :]]} "
            "trained in a segment of their own"
        )
    lost = sum(1 for t in c.turns if id(t) not in owner)
    if lost:
        out.append(
            f"chain {c.chain_id}: abandoned branch (retry or edited history; the conversation "
            f"went on in chain {live.chain_id}): its {lost} turn(s) after the divergence "
            "are not trained"
        )
    return out
