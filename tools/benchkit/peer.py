"""The full re-render peer: a turn planner that renders and tokenizes the WHOLE conversation.

It stands in for the server's `plan_turn` (patched in the process under test
only) and returns the plan the chain path would have made, so HTTP, parsing,
store writes and the response stay identical: only the tokenization strategy
differs (its ChainDecision events therefore also read "extend").

`python -m tools.benchkit.peer SERVE_ARGS` is `recorder serve SERVE_ARGS`
with this planner.
"""

from __future__ import annotations

import sys
from unittest import mock

from recorder.dialects.chat import ChatRequest
from recorder.model.tokenizer import Tokenizer
from recorder.model.tokens import SessionChains, TurnPlan, full_input_ids, plan_turn


def full_render_plan(
    chains: SessionChains, req: ChatRequest, tok: Tokenizer, context_length: int | None = None
) -> TurnPlan:
    """The baseline planner: render and tokenize the whole conversation every turn.

    The re-rendered tokens must start with the chain's tokens for its plan to
    be the chain path's (same chain, "extend", same prefix length). The
    context bound is the server's own check (`plan_turn`), made on the first
    turn; a re-render peer is measured on conversations that fit.
    """
    input_ids = full_input_ids(req, tok)
    main = chains.main
    if main is None:
        return plan_turn(
            chains, req, tok, context_length
        )  # the first request renders everything anyway
    n = len(main.tokens)
    if len(input_ids) <= n or main.tokens.tolist() != input_ids[:n]:
        raise RuntimeError(
            "baseline: the full re-render does not extend the chain's tokens, so no equivalent "
            "plan exists; the bench conversation must render stably"
        )
    return TurnPlan(
        chain_id=main.chain_id,
        action="extend",
        reason="extends",
        parent_chain_id=None,
        # As the tokenizer returns it (a list): the engine client sends lists as
        # they are, so the baseline pays no conversion to the chains' int32 array.
        input_ids=input_ids,  # type: ignore[arg-type]
        prefix_len=n,
        new_messages=len(req.messages) - main.boundaries[-1].n_input_messages - 1,
        main_line=main.main_line,
        request_digests=req.message_digests,
        system_digest=req.system_digest,
        render_digest=req.render_digest,
        eos_token_ids=tuple(tok.eos_token_ids),
    )


def serve_peer(serve_args: list[str]) -> None:
    """`recorder serve SERVE_ARGS` with the full re-render planner."""
    import recorder.server.turn as turn_module
    from recorder.server.commands import serve

    with mock.patch.object(turn_module, "plan_turn", full_render_plan):
        serve.main(serve_args, prog_name="recorder serve")


if __name__ == "__main__":
    serve_peer(sys.argv[1:])
