"""reclassify: projections, idempotence, change reports, determinism across stores."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import msgspec
import pytest
from builders import Log, small_logs, write_to

from recorder.log.events import NewEvent, SessionClosed, SessionOpened
from recorder.log.store import EventStore, open_store
from recorder.log.store.copy import copy_store
from recorder.log.store.tables import events as events_table
from replay import close_session_samples, encode_result
from replay import reducer as reducer_module
from replay import rules as rules_module
from replay.reclassify import SAMPLES_PREFIX, SUMMARY_PREFIX, reclassify
from replay.reducer import reduce_session
from replay.rules import PRESETS, Rules
from replay.samples import decode_result, digest_bytes, result_bytes, stored_result
from replay.turns import Turn


async def fill(store: EventStore) -> list[Log]:
    logs = small_logs()
    for log in logs:
        await write_to(store, log)
    return logs


async def digests(store: EventStore, name: str) -> dict[str, str]:
    return {sid: d for sid, (_p, d, _b) in (await store.load_projection(name)).items()}


async def test_reclassify_writes_projection_and_is_idempotent(store: EventStore) -> None:
    logs = await fill(store)
    first = await reclassify(store, Rules())
    assert first.previous is None and first.new_sessions == len(logs)
    assert first.projection.startswith(SAMPLES_PREFIX)
    assert first.projection.endswith(f"@{await store.last_position()}")
    assert first.kinds_after == {"final": 3, "placeholder": 1, "subagent": 1, "wipe": 1}
    assert first.status_after == {"aborted": 1, "completed": 5}
    rows = await store.load_projection(first.projection)
    assert set(rows) == {log.session_id for log in logs}
    for sid, (_pos, digest, payload) in rows.items():
        assert payload == stored_result(result_bytes(payload))  # stored compressed
        assert len(payload) < len(result_bytes(payload))
        assert digest_bytes(result_bytes(payload)) == digest  # of the canonical bytes
        assert decode_result(payload).session_id == sid

    again = await reclassify(store, Rules())
    assert again.projection == first.projection and again.previous == again.summary_projection
    assert again.changed_samples == [] and again.changed_segmentation == []
    assert again.new_sessions == 0
    assert again.kinds_before == again.kinds_after
    assert again.trainable_before == again.trainable_after == first.trainable_after
    assert await store.load_projection(first.projection) == rows
    names = await store.projection_names()
    assert names == [first.projection, first.summary_projection]


async def test_changed_rules_report_what_changed(sqlite_store: EventStore) -> None:
    await fill(sqlite_store)
    base = await reclassify(sqlite_store, Rules())
    masked = await reclassify(sqlite_store, Rules(mask_tito_failed=False))
    assert masked.previous == base.summary_projection
    assert masked.changed_segmentation == []
    assert masked.changed_samples == ["a-linear"]  # only its TITO-failed turn is unmasked
    assert masked.trainable_after == base.trainable_after + 2  # a-linear's TITO-failed turn
    collapsed = await reclassify(sqlite_store, PRESETS["collapse-final"])
    assert collapsed.previous == masked.summary_projection  # the latest other run
    assert collapsed.projection != base.projection
    assert sorted(collapsed.changed_segmentation) == ["b-compact", "c-subagent"]
    # Only sessions whose samples changed (against the masked run: a-linear's TITO turn is
    # masked again), though every one carries the new rules version; not d's placeholder.
    assert sorted(collapsed.changed_samples) == ["a-linear", "b-compact", "c-subagent"]
    assert collapsed.kinds_before == {"final": 3, "placeholder": 1, "subagent": 1, "wipe": 1}
    assert collapsed.kinds_after == {"final": 3, "placeholder": 1}


async def test_dry_run_writes_nothing_and_session_filter(sqlite_store: EventStore) -> None:
    await fill(sqlite_store)
    dry = await reclassify(sqlite_store, Rules(), dry_run=True)
    assert dry.sessions == 4 and await sqlite_store.projection_names() == []
    one = await reclassify(sqlite_store, Rules(), session_ids=["c-subagent"])
    assert one.sessions == 1
    assert list(await sqlite_store.load_projection(one.projection)) == ["c-subagent"]


async def test_live_close_path_equals_reclassify(store: EventStore) -> None:
    logs = await fill(store)
    report = await reclassify(store, Rules(routed_experts=(2, 2)))
    rows = await store.load_projection(report.projection)
    for log in logs:
        live = await close_session_samples(store, log.session_id, Rules(routed_experts=(2, 2)))
        assert encode_result(live) == result_bytes(rows[log.session_id][2])


async def test_same_samples_for_any_page_size_and_from_a_postgres_copy(
    sqlite_url: str, postgres_url: str
) -> None:
    src = await open_store(sqlite_url, create=True)
    dst = await open_store(postgres_url, create=True)
    try:
        await fill(src)
        tiny_pages = await reclassify(src, Rules(), page_size=1)
        want = await digests(src, tiny_pages.projection)
        big_pages = await reclassify(src, Rules(), page_size=1000)
        assert big_pages.projection == tiny_pages.projection
        assert big_pages.changed_samples == [] and big_pages.new_sessions == 0
        assert await digests(src, big_pages.projection) == want
        await copy_store(src, dst)  # type: ignore[arg-type]
        copied = await reclassify(dst, Rules(), page_size=3)
        assert copied.changed_samples == [] and copied.new_sessions == 0
        assert await digests(dst, copied.projection) == want
        # The Postgres copy's projection names the same log position.
        assert copied.projection == tiny_pages.projection
    finally:
        await src.close()
        await dst.close()


async def test_old_version_reward_event_reclassifies(store: EventStore) -> None:
    log = Log("old-reward").open()
    log.turn([1, 2], [3, 2])
    await write_to(store, log)
    # A RewardAssigned stored at schema v1 ({"value": x}), written raw.
    payload = msgspec.msgpack.encode({"type": "reward_assigned", "value": 0.75})
    engine = store.write_engine  # type: ignore[attr-defined]
    async with engine.begin() as conn:
        await conn.execute(
            events_table.insert().values(
                session_id="old-reward",
                seq=len(log.events),
                event_id=uuid.uuid4(),
                type="reward_assigned",
                version=1,
                ts=0.0,
                payload=payload,
            )
        )
    await store.append("old-reward", [NewEvent(event=SessionClosed())])
    (row,) = (await store.read_session("old-reward", from_seq=len(log.events)))[:1]
    assert row.version == 1
    report = await reclassify(store, Rules())
    (_pos, _d, payload_out) = (await store.load_projection(report.projection))["old-reward"]
    result = decode_result(payload_out)
    assert result.reward == 0.75 and result.samples[0].reward == 0.75


async def test_summary_projection_is_small(sqlite_store: EventStore) -> None:
    await fill(sqlite_store)
    report = await reclassify(sqlite_store, Rules())
    assert report.summary_projection.startswith(SUMMARY_PREFIX)
    samples = await sqlite_store.load_projection(report.projection)
    summary = await sqlite_store.load_projection(report.summary_projection)
    for sid in samples:
        assert len(summary[sid][2]) < len(samples[sid][2])
        assert summary[sid][1] == samples[sid][1]


async def test_session_opened_only_is_a_placeholder(sqlite_store: EventStore) -> None:
    await sqlite_store.append("empty", [NewEvent(event=SessionOpened(session_id="empty"))])
    report = await reclassify(sqlite_store, Rules())
    assert report.kinds_after == {"placeholder": 1}


async def test_workers_give_the_same_projection(store: EventStore) -> None:
    await fill(store)
    one = await reclassify(store, Rules(), dry_run=True)
    seen: list[int] = []
    two = await reclassify(store, Rules(), workers=2, on_progress=seen.append)
    assert two.sessions == one.sessions == 4
    assert seen and seen[-1] <= 4
    assert (two.kinds_after, two.status_after, two.trainable_after) == (
        one.kinds_after,
        one.status_after,
        one.trainable_after,
    )
    rows = await store.load_projection(two.projection)
    for sid, (_pos, _digest, payload) in rows.items():
        live = await close_session_samples(store, sid, Rules())
        assert result_bytes(payload) == encode_result(live)


async def test_the_acted_on_rule_reclassifies_an_old_log(
    sqlite_store: EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reducer 4 trains a left branch's acted-on answers: a log reduced under reducer 3
    (where such a branch was abandoned) reclassifies with that one session changed."""
    from test_acted_on import partial_compaction

    import replay.chains
    import replay.rules

    logs = await fill(sqlite_store)
    old_log = Log("partial-v2").open()
    partial_compaction(old_log, keys=False, answered=True)  # written before answer_keys
    old_log.reward(1.0).close()
    await write_to(sqlite_store, old_log)
    with monkeypatch.context() as m:  # reducer 3: no branch left was ever trained
        m.setattr(replay.rules, "REDUCER_VERSION", "3")
        m.setattr(replay.chains.Evidence, "acted_on", lambda self, t: False)
        m.setattr(replay.chains, "_acted_on_part", lambda c, owner, evidence: None)
        before = await reclassify(sqlite_store, Rules())
    after = await reclassify(sqlite_store, Rules())
    assert after.previous == before.summary_projection
    assert after.changed_samples == after.changed_segmentation == ["partial-v2"]
    assert after.trainable_after == before.trainable_after + 5  # turns 1 (2 tokens) and 2 (3)
    assert after.kinds_after["wipe"] == before.kinds_after["wipe"] + 1
    assert after.new_sessions == 0 and len(logs) + 1 == sum(
        1 for _ in await sqlite_store.session_ids()
    )


def _first_request_main_digest(turns: Sequence[Turn]) -> str | None:
    """Reducer version 3's rule: the first request's system prompt, unless a later request
    offering tools has another (kept here to replay an old log the old way)."""
    first = next((t.system_digest for t in turns if t.request is not None), None)
    for t in turns:
        if t.request is not None and t.request.n_tools != 0:
            return t.system_digest
    return first


async def test_new_side_request_rule_reports_the_sessions_it_changes(
    sqlite_store: EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reducer version 4 (without tools the main line is the conversation, not a title sent
    first): reclassify re-derives every session and reports exactly the one that changed."""
    await fill(sqlite_store)
    log = Log("e-no-tools").open()
    log.turn([90, 91], [92, 2], system="sys-title", n_tools=0)
    m0 = log.turn([1, 2, 3, 4, 5], [6, 2], n_tools=0, decision=("new", "first"), chain_id=1)
    log.turn(m0.then([7, 8]), [9, 2], n_tools=0, prefix_len=7, chain_id=1)
    log.close()
    await write_to(sqlite_store, log)
    with monkeypatch.context() as old:
        old.setattr(rules_module, "REDUCER_VERSION", "3")
        old.setattr(reducer_module, "main_system_digest", _first_request_main_digest)
        before = await reclassify(sqlite_store, Rules())
    after = await reclassify(sqlite_store, Rules())
    assert before.projection.startswith(f"{SAMPLES_PREFIX}r3-")
    assert after.projection.startswith(f"{SAMPLES_PREFIX}r{rules_module.REDUCER_VERSION}-")
    assert after.previous == before.summary_projection
    assert after.changed_segmentation == ["e-no-tools"]
    assert after.changed_samples == ["e-no-tools"]
    assert after.trainable_after == before.trainable_after + 2  # the title's 2 -> the talk's 4


def test_stored_results_read_back_and_rows_of_earlier_versions_still_decode() -> None:
    """A `samples/` row holds the canonical bytes zstd-compressed; rows written
    before that hold them as they are, and both decode to the same result."""
    result = reduce_session(small_logs()[0].events, small_logs()[0].arrays, Rules())
    canonical = encode_result(result)
    stored = stored_result(canonical)
    assert stored != canonical and result_bytes(stored) == canonical
    assert result_bytes(canonical) == canonical  # an earlier version's row
    assert decode_result(stored) == decode_result(canonical) == result


async def test_summaries_of_earlier_versions_are_compared_by_their_blake2b(
    sqlite_store: EventStore,
) -> None:
    """Summaries written before `content_xxh3` hold a BLAKE2b content digest only.
    A run against them writes both digests and reports only what changed; the
    run after it needs BLAKE2b no more."""
    import msgspec

    from replay.reclassify import SessionSummary, content_digest

    await fill(sqlite_store)
    base = await reclassify(sqlite_store, Rules())
    samples = await sqlite_store.load_projection(base.projection)
    legacy = []
    for sid, (pos, digest, payload) in (
        await sqlite_store.load_projection(base.summary_projection)
    ).items():
        summary = msgspec.msgpack.decode(payload, type=SessionSummary)
        old = msgspec.structs.replace(
            summary, content_xxh3="", content_digest=content_digest(decode_result(samples[sid][2]))
        )
        legacy.append((sid, pos, digest, msgspec.msgpack.encode(old)))
    await sqlite_store.save_projection(base.summary_projection, legacy)

    masked = await reclassify(sqlite_store, Rules(mask_tito_failed=False))
    assert masked.previous == base.summary_projection
    assert masked.changed_samples == ["a-linear"]  # not every session
    rows = await sqlite_store.load_projection(masked.summary_projection)
    written = [msgspec.msgpack.decode(p, type=SessionSummary) for _pos, _d, p in rows.values()]
    assert all(s.content_digest and s.content_xxh3 for s in written)

    collapsed = await reclassify(sqlite_store, PRESETS["collapse-final"])
    assert sorted(collapsed.changed_samples) == ["a-linear", "b-compact", "c-subagent"]
    rows = await sqlite_store.load_projection(collapsed.summary_projection)
    written = [msgspec.msgpack.decode(p, type=SessionSummary) for _pos, _d, p in rows.values()]
    assert all(s.content_xxh3 and not s.content_digest for s in written)
