"""`replay export`: samples for a trainer, as JSONL or Parquet.

Samples are re-derived from the log under the given rules (the same stream +
reducer as `replay reclassify`), written incrementally with bounded memory.
Placeholder samples (failed sessions) are exported too: trainers group
siblings by `rollout_id` and need every group's shape.

Mapping to slime's `slime.utils.types.Sample`:
    tokens            -> Sample.tokens                (prompt + response ids)
    response_len      -> Sample.response_length
    loss_mask         -> Sample.loss_mask             (response only)
    rollout_logprobs  -> Sample.rollout_log_probs     (response only; 0 where masked)
    reward            -> Sample.reward                (already allocated per segment)
    status            -> Sample.status = Sample.Status[status.upper()]
                         (completed/truncated/aborted/failed)
    weight_versions   -> Sample.weight_versions       (per response token here;
                         "" for inserted tokens)
    routed_experts    -> Sample.rollout_routed_experts, int32 (len(tokens), layers, top_k)
    rollout_id        -> the per-rollout id siblings share (slime PR #1933's per-rollout
                         loss reduction; for GRPO grouping use metadata.session.group_index)
    metadata.session.{group_index, sample_index, instance_id} -> Sample.group_index /
                         Sample.index / Sample.metadata; the rest of metadata
                         (segment_kind, segment_index, segment_count, finish_reason, aborts,
                         tito_masked_turns, rules_version, source_seqs) -> Sample.metadata
    prompt_len        -> the prompt is tokens[:prompt_len] (slime keeps text in Sample.prompt;
                         decode it if needed)

Mapping to verl's agent loop (`AgentLoopOutput`):
    prompt_ids        = tokens[:prompt_len]
    response_ids      = tokens[prompt_len:]
    response_mask     = loss_mask
    response_logprobs = rollout_logprobs
    routed_experts    = routed_experts (same (length, layers, top_k) contract verl's
                        `length, layer_num, topk_num = output.routed_experts.shape` reads)
    reward_score      = reward
    num_turns         = len(metadata.turns)
    extra_fields      = {rollout_id, status, metadata}  (status "aborted" = masked placeholder)

JSONL: one `Sample` per line as msgspec JSON (`routed_experts` is
`[shape, base64 int32 little-endian bytes]` or null). Parquet columns are the
Sample fields; `metadata` is a JSON string, `routed_experts` is split into
`routed_experts_shape` (list<int32>) and `routed_experts` (binary).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import msgspec

from recorder.log.store.base import EventStore
from replay.load import iter_session_logs
from replay.reducer import reduce_session
from replay.rules import Rules
from replay.samples import Sample, SessionResult, Tensor

Format = Literal["jsonl", "parquet"]


class ExportCounts(msgspec.Struct, kw_only=True):
    sessions: int = 0
    samples: int = 0
    placeholders: int = 0
    trainable_tokens: int = 0


def _parquet_schema() -> Any:
    import pyarrow as pa

    return pa.schema(
        [
            ("session_id", pa.string()),
            ("rollout_id", pa.string()),
            ("segment_kind", pa.string()),
            ("segment_index", pa.int32()),
            ("tokens", pa.list_(pa.int32())),
            ("prompt_len", pa.int32()),
            ("response_len", pa.int32()),
            ("loss_mask", pa.list_(pa.int8())),
            ("rollout_logprobs", pa.list_(pa.float64())),
            ("weight_versions", pa.list_(pa.string())),
            ("status", pa.string()),
            ("reward", pa.float64()),
            ("metadata", pa.string()),
            ("routed_experts_shape", pa.list_(pa.int32())),
            ("routed_experts", pa.binary()),
        ]
    )


def _parquet_row(s: Sample) -> dict[str, Any]:
    return {
        "session_id": s.session_id,
        "rollout_id": s.rollout_id,
        "segment_kind": str(s.metadata.get("segment_kind", "placeholder")),
        "segment_index": int(s.metadata.get("segment_index", 0)),
        "tokens": s.tokens,
        "prompt_len": s.prompt_len,
        "response_len": s.response_len,
        "loss_mask": s.loss_mask,
        "rollout_logprobs": s.rollout_logprobs,
        "weight_versions": s.weight_versions,
        "status": s.status,
        "reward": s.reward,
        "metadata": msgspec.json.encode(s.metadata, order="deterministic").decode(),
        "routed_experts_shape": list(s.routed_experts.shape) if s.routed_experts else None,
        "routed_experts": s.routed_experts.data if s.routed_experts else None,
    }


class _Writer:
    def __init__(self, out: Path, fmt: Format, batch: int) -> None:
        self.fmt = fmt
        self.batch = batch
        self.rows: list[dict[str, Any]] = []
        if fmt == "jsonl":
            self.fh = out.open("wb")
            self.encoder = msgspec.json.Encoder(order="deterministic")
        else:
            import pyarrow.parquet as pq

            self.schema = _parquet_schema()
            self.pq_writer = pq.ParquetWriter(str(out), self.schema)

    def write(self, sample: Sample) -> None:
        if self.fmt == "jsonl":
            self.fh.write(self.encoder.encode(sample) + b"\n")
            return
        self.rows.append(_parquet_row(sample))
        if len(self.rows) >= self.batch:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa

        if self.rows:
            self.pq_writer.write_table(pa.Table.from_pylist(self.rows, schema=self.schema))
            self.rows.clear()

    def close(self) -> None:
        if self.fmt == "jsonl":
            self.fh.close()
        else:
            self._flush()
            self.pq_writer.close()


async def export_samples(
    store: EventStore,
    out: Path,
    fmt: Format,
    rules: Rules,
    *,
    page_size: int = 1000,
    batch: int = 256,
    on_session: Callable[[SessionResult], None] | None = None,
) -> ExportCounts:
    """Write every session's samples under `rules` to `out`.

    A session the log stream yields twice (events after its close) is
    exported once, in its final form: rows of superseded yields are filtered
    out in a rewrite at the end (only when that happened).
    """
    counts = ExportCounts()
    writer = _Writer(out, fmt, batch)
    rows: list[tuple[str, int]] = []  # (session, yield number) per written row
    yields: dict[str, int] = {}
    try:
        async for log in iter_session_logs(
            store, page_size=page_size, routed_experts=rules.routed_experts is not None
        ):
            result = reduce_session(log.events, log.arrays, rules)
            n = yields[log.session_id] = yields.get(log.session_id, 0) + 1
            for s in result.samples:
                writer.write(s)
                rows.append((log.session_id, n))
            if on_session is not None:
                on_session(result)
    finally:
        writer.close()
    keep = [n == yields[sid] for sid, n in rows]
    if not all(keep):
        _drop_rows(out, fmt, keep)
    return _count(out, fmt, counts, len(yields))


def _drop_rows(out: Path, fmt: Format, keep: list[bool]) -> None:
    tmp = out.with_name(out.name + ".tmp")
    if fmt == "jsonl":
        with out.open("rb") as src, tmp.open("wb") as dst:
            for line, k in zip(src, keep, strict=True):
                if k:
                    dst.write(line)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pq.read_table(str(out))
        pq.write_table(table.filter(pa.array(keep)), str(tmp))
    tmp.replace(out)


def _count(out: Path, fmt: Format, counts: ExportCounts, sessions: int) -> ExportCounts:
    counts.sessions = sessions
    for s in read_samples(out, fmt):
        counts.samples += 1
        counts.placeholders += int("placeholder" in s.metadata)
        counts.trainable_tokens += sum(s.loss_mask)
    return counts


def read_samples(path: Path, fmt: Format) -> Iterator[Sample]:
    """Samples back from an export file (JSONL or Parquet)."""
    if fmt == "jsonl":
        decoder = msgspec.json.Decoder(Sample)
        with path.open("rb") as fh:
            for line in fh:
                yield decoder.decode(line)
        return
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(str(path))
    for batch in pf.iter_batches():
        for row in batch.to_pylist():
            shape = row.pop("routed_experts_shape")
            data = row.pop("routed_experts")
            row.pop("segment_kind")
            row.pop("segment_index")
            row["metadata"] = msgspec.json.decode(row["metadata"])
            row["routed_experts"] = Tensor(shape=tuple(shape), data=data) if shape else None
            yield msgspec.convert(row, Sample)
