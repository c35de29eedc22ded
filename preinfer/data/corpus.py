"""Corpus rows: local files (text, JSON lines, Parquet) and row sources read into Documents, and
an account of every row that was not used as it is (RowStats).

    stats = RowStats()
    for doc in iter_rows(rows, cfg, "train.jsonl", stats): ...   # rows: (where, dict) pairs
    stats.check(cfg.on_bad_rows)     # more than 1% unusable rows: a CorpusError (unless skip)

A row is unusable ("bad") when a field it needs is missing, null or not a string, or, for a
prompt/response pair, its response is empty, or, for a conversation (data.format=chat), its
messages are not a list of {"role", "content"} turns with string values, a role is not one of
ROLES, or no turn is the assistant's: such rows are skipped and counted by reason, with
the first few places ("train.jsonl line 7"). A text row whose text is empty is skipped and
counted too, but is not bad (corpora such as wikitext hold many). An empty file is an error
when named alone, and skipped with a count inside a directory. `cfg` is a
preinfer.data.tokenization.DataConfig (that module reads the corpus through this one).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq

from core.config import ConfigError
from preinfer.data.config import DataConfig, template_columns, template_fields

BAD_ROWS_LIMIT = 0.01  # data.on_bad_rows=error: more than this share of bad rows is refused
EXAMPLES = 3  # places of bad rows named in the log, the manifest and the error
ROLES = ("system", "user", "assistant", "tool")  # a chat turn's roles (TRL's conversational data)


class CorpusError(ConfigError):
    """The corpus cannot be read or is unusable; the message says why and what to do."""


class _EmptyFile(CorpusError):
    """A file holding no rows (caught by the directory reader, which skips and counts it)."""


@dataclass(frozen=True)
class Document:
    doc_id: str
    """Stable name of the document (relative path or row index)."""
    text: str
    """The document, or a pair's prompt."""
    response: str | None = None
    """A pair's response (format prompt_response); None for a document."""
    messages: tuple[tuple[str, str], ...] | None = None
    """A conversation's (role, content) turns (format chat; text is then ''); None otherwise."""

    def key(self) -> bytes:
        """The content that identifies it (hashed for the fingerprint and the split)."""
        if self.messages is not None:
            return json.dumps(self.messages, ensure_ascii=False).encode()
        if self.response is None:
            return self.text.encode()
        return self.text.encode() + b"\0" + self.response.encode()

    def turns(self) -> list[dict[str, str]]:
        """The conversation as chat-template messages: a chat row's turns, or a pair as a user
        turn (the prompt) and an assistant turn (the response)."""
        if self.messages is not None:
            return [{"role": r, "content": c} for r, c in self.messages]
        return [{"role": "user", "content": self.text},
                {"role": "assistant", "content": self.response}]  # fmt: skip


@dataclass
class RowStats:
    """What became of the rows of one read of the corpus."""

    rows: int = 0
    """Rows read (JSON lines, Parquet / HF rows)."""
    bad: Counter = field(default_factory=Counter)
    """Unusable rows skipped, by reason ("'response' missing")."""
    examples: list[str] = field(default_factory=list)
    """Where the first unusable rows are ("train.jsonl line 7")."""
    empty_text: int = 0
    """Text rows whose text is empty or blank (skipped; not counted as bad)."""
    template_filled: int = 0
    """Pairs with a prompt_template column missing or null (read as '', as documented)."""
    empty_files: list[str] = field(default_factory=list)
    """Files of a directory source that hold no rows (skipped)."""
    skipped_files: list[str] = field(default_factory=list)
    """Files of a directory source not read, and why ("a/x.bin (type .bin is not read)"): of
    a type not in FORMATS, or not a regular file (a FIFO, a device, a broken symlink)."""

    @property
    def n_bad(self) -> int:
        return sum(self.bad.values())

    def skip(self, reason: str, where: str) -> None:
        self.bad[reason] += 1
        if len(self.examples) < EXAMPLES:
            self.examples.append(where)

    def _bad_text(self) -> str:
        reasons = ", ".join(f"{n} with {r}" for r, n in self.bad.most_common())
        return f"{reasons}; e.g. {', '.join(self.examples)}"

    def check(self, on_bad_rows: str) -> None:
        """Refuse (CorpusError) when more than BAD_ROWS_LIMIT of the rows are bad and
        data.on_bad_rows is 'error'."""
        if on_bad_rows == "skip" or self.n_bad <= BAD_ROWS_LIMIT * self.rows:
            return
        raise CorpusError(
            f"data.source: {self.n_bad} of {self.rows} rows ({100 * self.n_bad / self.rows:.1f}%, "
            f"more than {BAD_ROWS_LIMIT:.0%}) are unusable ({self._bad_text()}); nothing was "
            "written. Fix those rows or the data.*_field names, or set data.on_bad_rows=skip "
            "to tokenize without them"
        )

    def to_dict(self) -> dict:
        """The manifest's "rows"."""
        return {"read": self.rows, "bad": dict(self.bad), "bad_examples": self.examples,
                "empty_text": self.empty_text, "template_filled": self.template_filled,
                "empty_files": self.empty_files,
                "skipped_files": self.skipped_files}  # fmt: skip

    def lines(self) -> list[str]:
        """What the log says of the rows not used as they are (nothing when all were)."""
        out = []
        if self.n_bad:
            out.append(f"skipped {self.n_bad} of {self.rows} rows as unusable ({self._bad_text()})")
        if self.empty_text:
            out.append(f"skipped {self.empty_text} of {self.rows} rows with empty text")
        if self.template_filled:
            out.append(f"{self.template_filled} pairs had a data.prompt_template column "
                       "missing or null, read as ''")  # fmt: skip
        if self.empty_files:
            shown = ", ".join(self.empty_files[:EXAMPLES])
            more = "" if len(self.empty_files) <= EXAMPLES else ", ..."
            out.append(f"skipped {len(self.empty_files)} empty file(s): {shown}{more}")
        if self.skipped_files:
            shown = ", ".join(self.skipped_files[:EXAMPLES])
            more = "" if len(self.skipped_files) <= EXAMPLES else ", ..."
            out.append(f"skipped {len(self.skipped_files)} file(s) in the data.source "
                       f"directory: {shown}{more} (tokenize reads {'/'.join(FORMATS)} files; "
                       "others are skipped)")  # fmt: skip
        return out


def columns(cfg: DataConfig, text_field: str) -> dict[str, str]:
    """{column: the config key naming it} of the columns a row must have."""
    if cfg.chat:
        return {cfg.messages_field: "data.messages_field"}
    if not cfg.pairs:
        return {text_field: "data.text_field"}
    if cfg.prompt_template is None:
        cols = {cfg.prompt_field: "data.prompt_field"}
    else:
        cols = dict.fromkeys(template_fields(cfg.prompt_template), "data.prompt_template")
    return {**cols, cfg.response_field: "data.response_field"}


def _missing(need: dict[str, str], have, label: str) -> CorpusError | None:
    for col, key in need.items():
        if col not in have:
            return CorpusError(
                f"{key}: column {col!r} not in {label} (columns: {', '.join(sorted(have))})"
            )
    return None


def _string(row: dict, name: str, where: str, stats: RowStats) -> str | None:
    """row[name] when it is a string; else None, the row counted as bad (missing, null, or
    another type)."""
    if name not in row:
        stats.skip(f"{name!r} missing", where)
        return None
    value = row[name]
    if not isinstance(value, str):
        stats.skip(f"{name!r} {'null' if value is None else 'not a string'}", where)
        return None
    return value


def _turns(value, name: str) -> tuple[tuple[str, str], ...] | str:
    """A messages value as (role, content) turns, or why it is unusable (a bad-row reason)."""
    if value is None:
        return f"{name!r} null"
    if not isinstance(value, list | tuple) or not value:
        return f"{name!r} not a non-empty list of turns"
    turns = []
    for turn in value:
        if not isinstance(turn, dict) or not all(
            isinstance(turn.get(k), str) for k in ("role", "content")
        ):
            return f"{name!r} holding a turn that is not {{'role': str, 'content': str}}"
        if turn["role"] not in ROLES:
            return f"{name!r} role {turn['role']!r} unknown (roles: {', '.join(ROLES)})"
        turns.append((turn["role"], turn["content"]))
    if not any(r == "assistant" for r, _ in turns):
        return f"{name!r} without an assistant turn (nothing to train on)"
    return tuple(turns)


def _document(row: dict, doc_id: str, where: str, cfg: DataConfig, text_field: str,
              stats: RowStats) -> Document | None:  # fmt: skip
    """The document (pair, conversation) of one row; None for a row skipped (counted in stats)."""
    if cfg.chat:
        if cfg.messages_field not in row:
            stats.skip(f"{cfg.messages_field!r} missing", where)
            return None
        turns = _turns(row[cfg.messages_field], cfg.messages_field)
        if isinstance(turns, str):
            stats.skip(turns, where)
            return None
        return Document(doc_id, "", messages=turns)
    if not cfg.pairs:
        text = _string(row, text_field, where, stats)
        if text is not None and not text.strip():
            stats.empty_text += 1
            return None
        return None if text is None else Document(doc_id, text)
    if cfg.prompt_template is None:
        prompt = _string(row, cfg.prompt_field, where, stats)
        if prompt is None:
            return None
    else:
        names = template_columns(cfg.prompt_template)
        if any(row.get(c) is None for c in names):
            stats.template_filled += 1
        prompt = cfg.prompt_template.format(
            **{c: "" if row.get(c) is None else row[c] for c in names}
        )
    response = _string(row, cfg.response_field, where, stats)
    if response is not None and not response.strip():  # null and empty: one rule
        stats.skip(f"{cfg.response_field!r} empty", where)
        return None
    return None if response is None else Document(doc_id, prompt, response)


def iter_rows(
    rows: Iterable[tuple[str, dict]],
    cfg: DataConfig,
    label: str,
    stats: RowStats | None = None,
    *,
    columns_known=None,
    text_field=None,
) -> Iterator[Document]:
    """Documents of `rows`, (where, row dict) pairs ("a.jsonl line 3", {...}). columns_known:
    the column names when known up front (checked first); else a column no row holds is an
    error at the end (nothing of it was yielded), and no row at all is an _EmptyFile."""
    stats = stats if stats is not None else RowStats()
    text_field = text_field or cfg.text_field
    need = columns(cfg, text_field)
    if columns_known is not None and (err := _missing(need, set(columns_known), label)):
        raise err
    seen: set[str] = set()
    n = 0
    for n, (where, row) in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise CorpusError(f"data.source: {where} is not an object: {row!r:.80}")
        stats.rows += 1
        if columns_known is None:
            seen.update(row)
        doc = _document(row, f"{label}#{n - 1}", where, cfg, text_field, stats)
        if doc is not None:
            yield doc
    if columns_known is None and n == 0:
        raise _EmptyFile(f"{label} holds no rows")
    if columns_known is None and (err := _missing(need, seen, label)):
        raise err


FORMATS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
}


def _local_files(paths: list[str], stats: RowStats) -> list[tuple[Path, bool]]:
    """(file, found in a directory) of each file a source names; what a directory holds that
    is not read (another type, not a regular file) goes to stats.skipped_files."""
    files: list[tuple[Path, bool]] = []
    for spec in paths:
        p = Path(spec).expanduser()
        if p.is_dir():
            for f in sorted(p.rglob("*")):
                if f.is_file() and f.suffix in FORMATS:
                    files.append((f, True))
                elif f.is_file():
                    stats.skipped_files.append(f"{f} (type {f.suffix or '(none)'} is not read)")
                elif not f.is_dir():
                    stats.skipped_files.append(f"{f} (not a regular file)")
        elif p.is_file():
            files.append((p, False))
        elif p.exists():  # a device (/dev/zero), a FIFO, a socket: no end, or no bytes to read
            raise CorpusError(
                f"data.source: {spec} is not a regular file (a device, FIFO or socket); give a "
                "file, a directory or 'builtin'"
            )
        else:
            raise CorpusError(
                f"data.source: {spec} does not exist; give a file, a directory or 'builtin'"
            )
    if not files:
        raise CorpusError(f"data.source: no .txt/.jsonl/.parquet files under {', '.join(paths)}")
    bad = [f.name for f, _ in files if f.suffix not in FORMATS]
    if bad:
        raise CorpusError(
            f"data.source: unsupported file type(s) {', '.join(bad)}; use {', '.join(sorted(FORMATS))}"
        )
    return files


def _decode(data: bytes, f: Path, offset: int = 0, line: int | None = None) -> str:
    """UTF-8 text of `data` (bytes of `f` from `offset`); invalid UTF-8 is a CorpusError naming
    the file, the line and the byte offset in the file."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        at = offset + e.start
        line = line if line is not None else data.count(b"\n", 0, e.start) + 1
        raise CorpusError(
            f"data.source: {f} line {line} is not valid UTF-8 (byte 0x{data[e.start]:02x} at "
            f"offset {at} of the file); re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        ) from None


def _json_rows(f: Path) -> Iterator[tuple[str, object]]:
    """("<file> line N", row) of JSON lines, one at a time (or of one JSON array, read whole)."""
    with open(f, "rb") as fh:
        head = fh.read(64).lstrip()
        fh.seek(0)
        if head.startswith(b"["):
            data = fh.read()
            try:
                rows = json.loads(_decode(data, f))
            except ValueError as e:
                raise CorpusError(f"data.source: {f} is not JSON: {e}") from None
            yield from ((f"{f.name} row {i}", row) for i, row in enumerate(rows))
            return
        offset = 0
        for n, raw in enumerate(fh, 1):
            line = _decode(raw, f, offset, n)
            offset += len(raw)
            if line.strip():
                try:
                    yield f"{f.name} line {n}", json.loads(line)
                except ValueError as e:
                    raise CorpusError(f"data.source: {f} line {n} is not JSON: {e}") from None


def _parquet_rows(f: Path, names: list[str]) -> Iterator[tuple[str, dict]]:
    pf = pq.ParquetFile(f)
    i = 0
    for batch in pf.iter_batches(batch_size=1024, columns=names):
        for row in batch.to_pylist():
            yield f"{f.name} row {i}", row
            i += 1


def _read_file(f: Path, cfg: DataConfig, stats: RowStats) -> Iterator[Document]:
    kind, label = FORMATS[f.suffix], f.name
    if kind == "text":
        if cfg.pairs or cfg.chat:
            what = "prompt and response columns" if cfg.pairs else "a messages column"
            raise CorpusError(
                f"data.source: {f} is a text file, but data.format={cfg.format} reads rows "
                f"with {what}; give .jsonl/.parquet files or an hf: dataset"
            )
        # as `datasets`' text loader reads it: universal newlines (\r\n and \r read as \n)
        text = _decode(f.read_bytes(), f).replace("\r\n", "\n").replace("\r", "\n")
        if not text.strip():
            raise _EmptyFile(f"{f} holds no text")
        yield from iter_rows([(label, {"text": text})], cfg, label, stats,
                             columns_known=["text"], text_field="text")  # fmt: skip
    elif kind == "json":
        yield from iter_rows(_json_rows(f), cfg, label, stats)
    else:
        meta = pq.read_metadata(f)
        if meta.num_rows == 0:
            raise _EmptyFile(f"{f} holds no rows")
        names = meta.schema.to_arrow_schema().names
        need = [c for c in columns(cfg, cfg.text_field) if c in names]
        yield from iter_rows(_parquet_rows(f, need), cfg, label, stats, columns_known=names)


def iter_local(
    paths: list[str], cfg: DataConfig, stats: RowStats | None = None
) -> Iterator[Document]:
    """Local files, streamed (a text file is one document; jsonl/parquet rows are read a line
    or a batch at a time). An empty file named alone is an error; inside a directory it is
    skipped and counted (stats.empty_files), unless every file is empty."""
    stats = stats if stats is not None else RowStats()
    files = _local_files(paths, stats)
    for f, in_dir in files:
        try:
            yield from _read_file(f, cfg, stats)
        except _EmptyFile:
            if not in_dir:
                raise CorpusError(
                    f"data.source: {f} is empty; give a file with data (an empty file inside a "
                    "directory is skipped)"
                ) from None
            stats.empty_files.append(str(f))
        except CorpusError:
            raise
        except (OSError, ValueError) as e:
            raise CorpusError(f"data.source: cannot read {f} as {FORMATS[f.suffix]}: {e}") from None
    if len(stats.empty_files) == len(files):
        raise CorpusError(
            f"data.source {','.join(paths)!r} holds no non-empty documents: all {len(files)} "
            "file(s) under it are empty; give files with data"
        )
