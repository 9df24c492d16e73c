"""The receiver's rules for one ``HiddenStateChunk``, as a pure function of the chunk, its payload
and the stream's state so far: `ChunkValidator.check` returns `Accepted` (what to apply) or
`Rejected` (which `Rule` broke, with its gRPC status). It reads no clock, touches no buffer,
counts no metric and changes no state; `stage_dit.receiver.Slot` applies the verdict.

Rules, in the order they are checked (each a `Rule`):

1. the chunk has a header (INVALID_ARGUMENT) naming the reservation's request id (INVALID_ARGUMENT);
2. its epoch is not older than the current one (INVALID_ARGUMENT), and the current epoch was not
   rejected earlier (FAILED_PRECONDITION: only a newer epoch, an AR retry, may continue);
3. from here on a violation poisons the chunk's epoch (`Rejected.poisons`): the sequence number is
   the next expected one (no gap, duplicate or reordering; INVALID_ARGUMENT);
4. sequence 0 carries the `StreamMetadata`: supported protocol major (FAILED_PRECONDITION), the
   DiT's hidden size, an allowed dtype, ``expected_rows >= 1``, all rows within the slot,
   ``answer_start_index <= expected_rows`` (INVALID_ARGUMENT);
5. the header agrees with its payload (`mammoth_core.wire.validate_header`: dtype equal to the
   stream's, shape ``[rows, hidden]``, ``len(token_ids) == rows``, byte count; INVALID_ARGUMENT);
6. rows carry role CONDITION or NEGATIVE (NEGATIVE only when announced), every value finite,
   ``row_offset`` equal to the rows already received for the role, no more rows than announced
   (INVALID_ARGUMENT);
7. a `StreamEnd` carries totals equal to the rows announced and received, and CRC-32C equal to the
   received bytes' (DATA_LOSS).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import grpc
import numpy as np
import torch

from mammoth_core import wire
from mammoth_core.pb import mammoth_pb2 as pb
from mammoth_core.wire import WireError

ROLES = (pb.CONDITION, pb.NEGATIVE)

#: Exponent mask of each wire dtype, viewed as unsigned integers: all exponent bits set = NaN or inf.
_EXPONENT_MASKS = {
    torch.bfloat16: (np.uint16, 0x7F80),
    torch.float16: (np.uint16, 0x7C00),
    torch.float32: (np.uint32, 0x7F800000),
}


def all_finite(data: bytes | memoryview, dtype: torch.dtype) -> bool:
    """Whether every value of the raw little-endian ``data`` (``dtype`` from `wire.ALLOWED_DTYPES`)
    is finite; bit tests on the exponent, no float conversion, no copy of ``data``."""
    kind, mask = _EXPONENT_MASKS[dtype]
    bits = np.frombuffer(data, dtype=np.dtype(kind).newbyteorder("<"))
    return not bool(np.any((bits & kind(mask)) == kind(mask)))


class Rule(enum.Enum):
    """A receiver rule a chunk can break (the module docstring gives the order)."""

    NO_HEADER = "no_header"
    WRONG_REQUEST = "wrong_request"
    STALE_EPOCH = "stale_epoch"
    POISONED_EPOCH = "poisoned_epoch"
    SEQUENCE = "sequence"
    NO_METADATA = "no_metadata"
    PROTOCOL_MAJOR = "protocol_major"
    METADATA_HIDDEN_SIZE = "metadata_hidden_size"
    METADATA_DTYPE = "metadata_dtype"
    EXPECTED_ROWS = "expected_rows"
    SLOT_CAPACITY = "slot_capacity"
    ANSWER_START = "answer_start"
    HEADER = "header"
    ROLE = "role"
    NON_FINITE = "non_finite"
    UNANNOUNCED_NEGATIVE = "unannounced_negative"
    ROW_OFFSET = "row_offset"
    TOO_MANY_ROWS = "too_many_rows"
    END_CONDITION_TOTALS = "end_condition_totals"
    END_NEGATIVE_TOTALS = "end_negative_totals"
    END_CRC = "end_crc"


@dataclass
class EpochState:
    """What the receiver knows of one epoch of a stream; owned and updated by the slot.

    Attributes:
        epoch: the epoch number.
        metadata / dtype: the stream's `StreamMetadata` and wire dtype (None before sequence 0).
        next_sequence: the sequence number the next chunk must carry.
        rows / crc: rows received and CRC-32C so far, per role (``pb.CONDITION``, ``pb.NEGATIVE``).
        chunks: chunks accepted.
        poisoned: why the epoch was rejected (None while it was not).
    """

    epoch: int
    metadata: pb.StreamMetadata | None = None
    dtype: torch.dtype | None = None
    next_sequence: int = 0
    rows: dict[int, int] = field(default_factory=lambda: {pb.CONDITION: 0, pb.NEGATIVE: 0})
    crc: dict[int, int] = field(default_factory=lambda: {pb.CONDITION: 0, pb.NEGATIVE: 0})
    chunks: int = 0
    poisoned: str | None = None


@dataclass(frozen=True)
class Accepted:
    """A valid chunk and what applying it changes.

    Attributes:
        epoch: the chunk's epoch; ``new_epoch`` when it starts one (an AR retry or the first chunk).
        metadata / dtype: the epoch's stream metadata and dtype (from this chunk on sequence 0).
        role / rows / nbytes: the rows it carries (0 rows: the end alone) and their payload bytes.
        payload: the payload, ``nbytes`` long (a view of the received message when split).
        rows_after / crc_after: per-role rows received and CRC-32C once it is applied.
        final: it carries the `StreamEnd` (totals and checksums verified).
    """

    epoch: int
    new_epoch: bool
    metadata: pb.StreamMetadata
    dtype: torch.dtype
    role: int
    rows: int
    nbytes: int
    payload: bytes | memoryview
    rows_after: dict[int, int]
    crc_after: dict[int, int]
    final: bool


@dataclass(frozen=True)
class Rejected:
    """A chunk that broke ``rule``.

    Attributes:
        rule: which rule.
        code / message: the status the push is answered with, and why.
        poisons: the chunk belongs to the current epoch or a newer one and that epoch is now
            rejected (its rows discarded); False for rules 1 and 2 (another caller's or an old chunk).
        new_epoch: the chunk would have started a new epoch (which starts, rejected).
        epoch: the poisoned epoch (0 when ``poisons`` is False).
    """

    rule: Rule
    code: grpc.StatusCode
    message: str
    poisons: bool = False
    new_epoch: bool = False
    epoch: int = 0

    def error(self) -> WireError:
        """The `WireError` the receiver raises for this rejection."""
        return WireError(self.code, self.message)


class _Broken(Exception):
    """Internal: a rule broke (turned into `Rejected` by `ChunkValidator.check`)."""

    def __init__(self, rule: Rule, message: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT):
        super().__init__(message)
        self.rule, self.message, self.code = rule, message, code


class ChunkValidator:
    """The rules of the module docstring for one slot geometry.

    Args:
        hidden_size: the DiT's row width (the AR's hidden size).
        max_rows: CONDITION + NEGATIVE rows a slot holds (``max_rows_per_slot``).
        capacity_bytes: a slot's staging bytes (rows of a wider dtype fit fewer).
    """

    def __init__(self, hidden_size: int, max_rows: int, capacity_bytes: int) -> None:
        self.hidden_size = int(hidden_size)
        self.max_rows = int(max_rows)
        self.capacity_bytes = int(capacity_bytes)

    def check(self, chunk: pb.HiddenStateChunk, payload: bytes | memoryview, *, request_id: str,
              current: EpochState | None) -> Accepted | Rejected:
        """The verdict on ``chunk`` (payload ``payload``) for the reservation of ``request_id``
        whose current epoch is ``current`` (None before any accepted chunk). Pure."""
        try:
            epoch = self._identity(chunk, request_id, current)
        except _Broken as broken:
            return Rejected(broken.rule, broken.code, broken.message)
        new_epoch = current is None or epoch > current.epoch
        state = EpochState(epoch) if new_epoch else current
        try:
            return self._contents(chunk, payload, state, new_epoch)
        except _Broken as broken:
            return Rejected(broken.rule, broken.code, broken.message, poisons=True, new_epoch=new_epoch, epoch=epoch)

    @staticmethod
    def _identity(chunk: pb.HiddenStateChunk, request_id: str, current: EpochState | None) -> int:
        """Rules 1 and 2; returns the chunk's epoch."""
        if not chunk.HasField("header"):
            raise _Broken(Rule.NO_HEADER, "chunk without header")
        h = chunk.header
        if h.request_id != request_id:
            raise _Broken(Rule.WRONG_REQUEST, f"request id {h.request_id!r} does not own this reservation")
        if current is not None and h.epoch < current.epoch:
            raise _Broken(Rule.STALE_EPOCH, f"stale epoch {h.epoch} (current epoch is {current.epoch})")
        if current is not None and h.epoch == current.epoch and current.poisoned:
            raise _Broken(Rule.POISONED_EPOCH,
                          f"epoch {h.epoch} was rejected earlier ({current.poisoned}); retry with a newer epoch",
                          grpc.StatusCode.FAILED_PRECONDITION)
        return h.epoch

    def _contents(self, chunk: pb.HiddenStateChunk, payload: bytes | memoryview, st: EpochState,
                  new_epoch: bool) -> Accepted:
        """Rules 3 to 7 against the epoch state ``st``."""
        h = chunk.header
        if h.sequence != st.next_sequence:
            kind = "duplicate or reordered" if h.sequence < st.next_sequence else "gap before"
            raise _Broken(Rule.SEQUENCE, f"sequence {h.sequence}: {kind} (expected {st.next_sequence})")
        md, dtype = st.metadata, st.dtype
        if h.sequence == 0:
            if not chunk.HasField("metadata"):
                raise _Broken(Rule.NO_METADATA, "sequence 0 must carry the stream metadata")
            md = chunk.metadata
            dtype = self._metadata_dtype(md)
        try:
            info = wire.validate_header(h, len(payload), hidden_size=self.hidden_size, max_rows=self.max_rows,
                                        expected_dtype=dtype)
        except WireError as err:
            raise _Broken(Rule.HEADER, err.message, err.code) from None
        rows_after, crc_after = dict(st.rows), dict(st.crc)
        if info.rows:
            self._check_rows(h, payload, info.rows, md, dtype, st)
            rows_after[h.role] += info.rows
            crc_after[h.role] = wire.crc32c(payload, st.crc[h.role])
        final = chunk.HasField("end")
        if final:
            self._check_end(chunk.end, md, rows_after, crc_after)
        return Accepted(epoch=st.epoch, new_epoch=new_epoch, metadata=md, dtype=dtype, role=h.role,
                        rows=info.rows, nbytes=info.nbytes, payload=payload, rows_after=rows_after,
                        crc_after=crc_after, final=final)

    def _metadata_dtype(self, md: pb.StreamMetadata) -> torch.dtype:
        """Rule 4; returns the stream's dtype."""
        if md.protocol_major != wire.PROTOCOL_MAJOR:
            raise _Broken(Rule.PROTOCOL_MAJOR,
                          f"unsupported protocol major version {md.protocol_major} (this DiT speaks "
                          f"{wire.PROTOCOL_MAJOR}.{wire.PROTOCOL_MINOR})", grpc.StatusCode.FAILED_PRECONDITION)
        if md.hidden_size != self.hidden_size:
            raise _Broken(Rule.METADATA_HIDDEN_SIZE,
                          f"hidden size {md.hidden_size} differs from the DiT's {self.hidden_size}")
        try:
            dtype = wire.dtype_from_proto(md.dtype)
        except WireError as err:
            raise _Broken(Rule.METADATA_DTYPE, err.message, err.code) from None
        if md.expected_rows < 1:
            raise _Broken(Rule.EXPECTED_ROWS, "expected_rows must be >= 1")
        fit = min(self.capacity_bytes // (self.hidden_size * wire.itemsize(dtype)), self.max_rows)
        if md.expected_rows + md.expected_negative_rows > fit:
            raise _Broken(Rule.SLOT_CAPACITY,
                          f"{md.expected_rows + md.expected_negative_rows} rows exceed the slot capacity of "
                          f"{fit} rows (max_rows_per_slot)")
        if md.answer_start_index > md.expected_rows:
            raise _Broken(Rule.ANSWER_START, "answer_start_index is beyond the expected rows")
        return dtype

    @staticmethod
    def _check_rows(h: pb.ChunkHeader, payload, rows: int, md: pb.StreamMetadata, dtype: torch.dtype,
                    st: EpochState) -> None:
        """Rule 6 for a chunk carrying ``rows`` rows."""
        role = h.role
        if role not in ROLES:
            raise _Broken(Rule.ROLE, f"role {role} is not CONDITION or NEGATIVE")
        name = pb.Role.Name(role)
        if not all_finite(payload, dtype):
            # NaN/inf conditions would denoise into a blank image without a word.
            raise _Broken(Rule.NON_FINITE,
                          f"{name} rows {h.row_offset}..{h.row_offset + rows - 1} hold non-finite values (NaN or inf)")
        expected = md.expected_rows if role == pb.CONDITION else md.expected_negative_rows
        if role == pb.NEGATIVE and expected == 0:
            raise _Broken(Rule.UNANNOUNCED_NEGATIVE, "NEGATIVE rows in a stream that announced none")
        if h.row_offset != st.rows[role]:
            raise _Broken(Rule.ROW_OFFSET, f"row_offset {h.row_offset} for {name}, expected {st.rows[role]}")
        if st.rows[role] + rows > expected:
            raise _Broken(Rule.TOO_MANY_ROWS, f"{st.rows[role] + rows} {name} rows exceed the announced {expected}")

    @staticmethod
    def _check_end(end: pb.StreamEnd, md: pb.StreamMetadata, rows: dict[int, int], crc: dict[int, int]) -> None:
        """Rule 7: ``rows`` / ``crc`` are the per-role totals including the final chunk."""
        loss = grpc.StatusCode.DATA_LOSS
        if end.total_rows != md.expected_rows or end.total_rows != rows[pb.CONDITION]:
            raise _Broken(Rule.END_CONDITION_TOTALS,
                          f"stream ended with {rows[pb.CONDITION]} CONDITION rows received, "
                          f"{end.total_rows} sent, {md.expected_rows} announced", loss)
        if end.total_negative_rows != md.expected_negative_rows or end.total_negative_rows != rows[pb.NEGATIVE]:
            raise _Broken(Rule.END_NEGATIVE_TOTALS,
                          f"stream ended with {rows[pb.NEGATIVE]} NEGATIVE rows received, "
                          f"{end.total_negative_rows} sent, {md.expected_negative_rows} announced", loss)
        if end.crc32c != crc[pb.CONDITION] or end.negative_crc32c != crc[pb.NEGATIVE]:
            raise _Broken(Rule.END_CRC, "CRC-32C of the received rows differs from the sender's", loss)
