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

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec

from recorder.log.store.base import EventStore
from replay.load import iter_session_logs
from replay.partitions import PartStat
from replay.reducer import reduce_session
from replay.rules import Rules
from replay.samples import Sample, SessionResult, Tensor

Format = Literal["jsonl", "parquet"]


class ExportCounts(msgspec.Struct, kw_only=True):
    sessions: int = 0
    samples: int = 0
    placeholders: int = 0
    trainable_tokens: int = 0
    # Parallel runs: per worker, where it ran and its peak memory.
    partitions: list[PartStat] = []


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


class ParquetWriter:
    """Samples to a Parquet file, a row group per `batch` samples (so the same
    samples in the same order give the same bytes, however they were produced)."""

    def __init__(self, out: Path, batch: int) -> None:
        import pyarrow.parquet as pq

        self.batch = batch
        self.rows: list[dict[str, Any]] = []
        self.schema = _parquet_schema()
        self.pq_writer = pq.ParquetWriter(str(out), self.schema)

    def write(self, sample: Sample) -> None:
        self.rows.append(_parquet_row(sample))
        if len(self.rows) >= self.batch:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa

        if self.rows:
            self.pq_writer.write_table(pa.Table.from_pylist(self.rows, schema=self.schema))
            self.rows.clear()

    def close(self) -> None:
        self._flush()
        self.pq_writer.close()


class _Writer:
    def __init__(self, out: Path, fmt: Format, batch: int) -> None:
        self.fmt = fmt
        if fmt == "jsonl":
            self.fh = out.open("wb")
            self.encoder = msgspec.json.Encoder(order="deterministic")
        else:
            self.parquet = ParquetWriter(out, batch)

    def write(self, sample: Sample) -> None:
        if self.fmt == "jsonl":
            self.fh.write(self.encoder.encode(sample) + b"\n")
        else:
            self.parquet.write(sample)

    def close(self) -> None:
        if self.fmt == "jsonl":
            self.fh.close()
        else:
            self.parquet.close()


_json_encoder = msgspec.json.Encoder(order="deterministic")
_blob_encoder = msgspec.msgpack.Encoder()
_blob_decoder = msgspec.msgpack.Decoder(list[Sample])


def part_blob(samples: list[Sample], fmt: Format) -> bytes:
    """One session's samples as a parallel worker hands them to the driver:
    the finished JSONL lines, or (Parquet, encoded by the driver) msgpack,
    which carries every float exactly."""
    if fmt == "jsonl":
        return b"".join(_json_encoder.encode(s) + b"\n" for s in samples)
    return _blob_encoder.encode(samples)


def samples_from_blob(blob: bytes) -> list[Sample]:
    return _blob_decoder.decode(blob)


async def export_samples(
    store: EventStore,
    out: Path,
    fmt: Format,
    rules: Rules,
    *,
    page_size: int = 1000,
    batch: int = 256,
    workers: int | None = 1,
    ray: str | None = None,
    on_session: Callable[[SessionResult], None] | None = None,
    on_progress: Callable[[int], None] | None = None,
    sizes: Mapping[str, int] | None = None,
) -> ExportCounts:
    """Write every session's samples under `rules` to `out`.

    A session the log stream yields twice (events after its close) is
    exported once, in its final form: rows of superseded yields are filtered
    out in a rewrite at the end (only when that happened).

    `workers` > 1 reduces in that many local processes (None: one per core,
    fewer for a small log), `ray` (an address,
    "" for Ray's default) in Ray tasks, each over a range of sessions (see
    `replay.parallel`); the file is the same, byte for byte. `on_session` gets
    each result (one process only); `on_progress` the count of sessions done.
    `sizes`: the log's sessions and their numbers of events if the caller has
    listed them already (`replay.parallel.wanted_sizes(store, None)`).
    """
    if workers is not None and workers < 1:
        raise ValueError("workers must be >= 1")
    from replay.parallel import resolve_workers

    workers, sizes = await resolve_workers(store, workers, ray, sizes)
    if workers != 1 or ray is not None:
        return await _export_parallel(
            store, out, fmt, rules, page_size, batch, workers, ray, sizes, on_progress
        )
    writer = _Writer(out, fmt, batch)
    rows: list[tuple[str, int]] = []  # (session, yield number) per written row
    yields: dict[str, int] = {}
    kept: dict[str, Tally] = {}  # per session, the tally of its last yield (the rows kept)
    try:
        async for log in iter_session_logs(
            store, page_size=page_size, routed_experts=rules.routed_experts is not None
        ):
            result = reduce_session(log.events, log.arrays, rules)
            n = yields[log.session_id] = yields.get(log.session_id, 0) + 1
            kept[log.session_id] = tally(result.samples)
            for s in result.samples:
                writer.write(s)
                rows.append((log.session_id, n))
            if on_session is not None:
                on_session(result)
            if on_progress is not None:
                on_progress(len(yields))
    finally:
        writer.close()
    keep = [n == yields[sid] for sid, n in rows]
    if not all(keep):
        _drop_rows(out, fmt, keep, batch)
    return counted(kept.values())


async def _export_parallel(
    store: EventStore,
    out: Path,
    fmt: Format,
    rules: Rules,
    page_size: int,
    batch: int,
    workers: int | None,
    ray: str | None,
    sizes: Mapping[str, int] | None,
    on_progress: Callable[[int], None] | None,
) -> ExportCounts:
    from replay import parallel

    base = await parallel.whole_log_job(
        store, "export", rules, page_size=page_size, batch=batch, fmt=fmt
    )
    part_dir = parallel.part_directory(out)
    try:
        results = await parallel.run_jobs(
            base, store, sizes, workers=workers, ray=ray, part_dir=part_dir, on_progress=on_progress
        )
        counts = parallel.merge_export(results, out, fmt, batch)
    finally:
        parallel.remove_parts(part_dir)
    counts.partitions = parallel.partition_stats(results)
    return counts


def _drop_rows(out: Path, fmt: Format, keep: list[bool], batch: int) -> None:
    tmp = out.with_name(out.name + ".tmp")
    if fmt == "jsonl":
        with out.open("rb") as src, tmp.open("wb") as dst:
            for line, k in zip(src, keep, strict=True):
                if k:
                    dst.write(line)
    else:
        # Through the same writer: row groups as if only the kept rows were written.
        writer = ParquetWriter(tmp, batch)
        try:
            for sample, k in zip(read_samples(out, fmt), keep, strict=True):
                if k:
                    writer.write(sample)
        finally:
            writer.close()
    tmp.replace(out)


# What `ExportCounts` counts of one session's samples, taken as they are
# written: (samples, placeholders, trainable tokens). Counting the file
# afterwards decoded every sample again, on one core after the workers were
# done (a quarter of a parallel export's wall time).
Tally = tuple[int, int, int]


def tally(samples: Sequence[Sample]) -> Tally:
    return (
        len(samples),
        sum("placeholder" in s.metadata for s in samples),
        sum(sum(s.loss_mask) for s in samples),
    )


def counted(tallies: Iterable[Tally]) -> ExportCounts:
    """The counts of an export whose sessions' written samples tally as given."""
    counts = ExportCounts()
    for samples, placeholders, trainable in tallies:
        counts.sessions += 1
        counts.samples += samples
        counts.placeholders += placeholders
        counts.trainable_tokens += trainable
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
