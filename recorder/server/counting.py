"""POST /v1/messages/count_tokens: the length the next turn's engine input will really have.

A request that extends a chain is not rendered from scratch: its engine input
is the chain's exact tokens (the model's earlier outputs verbatim, including
reasoning the client never saw, because the request did not enable thinking)
plus the new messages. A from-scratch render of the body counts the echoed
answers, which lack that hidden reasoning, and so comes out short (issue 20:
12 tokens short). So the count is the length of the input `plan_turn` would
build now, from the session's chains.

The plan runs on a snapshot of the chains, so the live session is left
exactly as it was (`plan_turn` only reserves a chain id, on the snapshot) and
a turn committing meanwhile cannot change what the count reads: chain tokens
only ever grow, and the snapshot holds its own lists of boundaries. No lock
is taken: on one of several replicas the count reads the chains this replica
holds, which may miss another replica's latest turns.
"""

from __future__ import annotations

import asyncio

import msgspec

from recorder.dialects.chat import ChatRequest
from recorder.model.tokens import SessionChains, Tokenizer, count_input_tokens, plan_turn

# Counting a fresh render of a Claude Code body (~80 KB, ~20k tokens) takes ~50 ms:
# off the event loop, as a turn's plan.
_THREAD_CHARS = 32 * 1024


async def next_input_tokens(
    chains: SessionChains | None, chat: ChatRequest, tok: Tokenizer, body_len: int
) -> int:
    """How many tokens the engine input of `chat`, sent now as a turn, would have."""
    if chains is None:  # a closed session keeps no chains: count a fresh render
        return await asyncio.to_thread(count_input_tokens, chat, tok)
    snapshot = _snapshot(chains)
    if body_len > _THREAD_CHARS:
        plan = await asyncio.to_thread(plan_turn, snapshot, chat, tok)
    else:
        plan = plan_turn(snapshot, chat, tok)
    return len(plan.input_ids)


def _snapshot(chains: SessionChains) -> SessionChains:
    """The chains as they are now: a commit changes the live ones, never these."""
    return SessionChains(
        chains={
            chain_id: msgspec.structs.replace(chain, boundaries=list(chain.boundaries))
            for chain_id, chain in chains.chains.items()
        },
        main_chain_id=chains.main_chain_id,
        pending_dispatches=list(chains.pending_dispatches),
        next_chain_id=chains.next_chain_id,
        clock=chains.clock,
        max_chains=chains.max_chains,
    )
