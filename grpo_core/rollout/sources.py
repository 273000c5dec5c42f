"""Prompt dataset files as users have them (issue 27, item 1): JSON lines, Parquet, CSV, Arrow, a folder saved with
``Dataset.save_to_disk`` and a Hub dataset id resolved from the local Hugging Face cache.

Values are read as written. JSON lines are parsed row by row with the standard ``json`` module and kept as parsed:
``datasets``' json loader stores a column whose rows hold different JSON kinds (``"007"`` in one row, ``7`` in
another) as its ``Json`` feature but keeps a string that parses as JSON (``"007"``, ``"true"``, ``"null"``)
unquoted, so it read back as ``7``, ``True`` and ``None``. CSV cells are strings (an empty cell ``""``, ``NA``
stays ``"NA"``) unless ``column_types`` names a type for the column; Parquet, Arrow and saved folders carry their
own types.

Every reader returns a map-style dataset: a list of row dicts for JSON lines and CSV (values as parsed), a
``datasets.Dataset`` for the typed forms. Errors start with ``where``, the setting and its value
(``rollout.dataset='data.csv'``, ``rollout.datasets[1].path='...'``), and name the file and the fix.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from grpo_core.config import dataset_form, user_path
from grpo_core.config.rollout import unknown_prefix_hint
from grpo_core.errors import ConfigError

#: Compressed files the readers open (fsspec's compression by suffix).
COMPRESSED_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".lz4", ".zip")
#: File suffix -> form of a plain path (compression suffixes stripped first).
SUFFIX_FORMS = {".jsonl": "json", ".json": "json", ".ndjson": "json", ".parquet": "parquet", ".csv": "csv"}
SUFFIX_FORMS |= {".tsv": "csv", ".arrow": "arrow"}
#: ``column_types`` values and how a CSV cell is read with each.
COLUMN_TYPES = ("str", "int", "float", "bool", "json")
_JSON_FIX = 'write one JSON object per line ({"prompt": [{"role": "user", "content": "..."}]}), or fix the path'


def _quiet_datasets() -> contextlib.AbstractContextManager:
    """No progress bars while a reader runs (they would interleave with the run's log)."""
    import datasets

    @contextlib.contextmanager
    def quiet() -> Iterator[None]:
        bars_off = datasets.utils.are_progress_bars_disabled()
        datasets.utils.disable_progress_bars()
        try:
            yield
        finally:
            if not bars_off:
                datasets.utils.enable_progress_bars()

    return quiet()


def data_form(path: Path) -> str | None:
    """The form a file's suffix tells (``json``, ``parquet``, ``csv``, ``arrow``), compression suffixes ignored."""
    suffixes = [s.lower() for s in path.suffixes]
    while suffixes and suffixes[-1] in COMPRESSED_SUFFIXES:
        suffixes.pop()
    return SUFFIX_FORMS.get(suffixes[-1]) if suffixes else None


def local_files(pattern: str, where: str, kind: str) -> list[Path]:
    """The local files ``pattern`` names: the path, or every match of a glob ([] for a URL, which ``datasets``
    reads). ``~`` and ``$VARS`` are expanded.

    Raises:
        ConfigError: nothing matches, or the path is a folder (names ``where`` and the fix).
    """
    if "://" in pattern:
        return []
    path = user_path(pattern)
    if glob.has_magic(pattern):
        files = sorted(Path(p) for p in glob.glob(str(path)) if Path(p).is_file())
        if not files:
            raise ConfigError(f"{where}: no file matches; fix the pattern")
        return files
    if path.is_dir():
        raise ConfigError(
            f"{where}: {path} is a folder; name a {kind} file in it, a glob ('{path}/*'), or a folder "
            "saved with Dataset.save_to_disk as 'disk:FOLDER'"
        )
    if not path.is_file():
        raise ConfigError(f"{where}: no such file {path.resolve()}; fix the path")
    return [path]


def _read_bytes(path: Path | str) -> bytes:
    import fsspec

    with fsspec.open(str(path), "rb", compression="infer") as f:
        return f.read()  # pyright: ignore[reportAttributeAccessIssue] - one path opens one file


def json_rows(path: Path | str, where: str) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file (or of a file holding one JSON array of objects), in order; a
    compressed file (``.gz``, ...) is opened by its suffix.

    Raises:
        ConfigError: a line that is not UTF-8 text, not JSON or not an object (its number and first characters);
            names ``where``, the file and the fix.
    """
    try:
        data = _read_bytes(path)
    except OSError as e:
        raise ConfigError(f"{where}: {path} cannot be read ({e}); fix the path") from None
    if data.lstrip().startswith(b"["):
        try:
            rows = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{where}: {path} is not a JSON array of objects ({e}); {_JSON_FIX}") from None
        bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict)), None)
        if bad is not None:
            raise ConfigError(f"{where}: {path}, item {bad} of the array is not a JSON object; {_JSON_FIX}")
        return rows
    rows = []
    for number, raw in enumerate(data.splitlines(), start=1):
        try:
            line = raw.decode("utf-8").strip()
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"{where}: {path}, line {number} is not UTF-8 text (byte {e.start}); {_JSON_FIX}"
            ) from None
        if not line:
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"{where}: {path}, line {number} is not JSON ({e.msg}, column {e.colno}): {line[:60]!r}; {_JSON_FIX}"
            ) from None
        if not isinstance(value, dict):
            raise ConfigError(
                f"{where}: {path}, line {number} is a JSON {type(value).__name__}, not an object: {line[:60]!r}; "
                f"{_JSON_FIX}"
            )
        rows.append(value)
    return rows


def exact_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` as parsed, every row given every column (None where a row lacks a key), so every value reads back
    exactly as written: no column is typed as a whole (``datasets``' Json feature re-typed JSON-looking strings,
    and its decoder refuses integers beyond 64 bits)."""
    columns: dict[str, None] = {}
    for row in rows:
        columns.update(dict.fromkeys(row))
    return [{name: row.get(name) for name in columns} for row in rows]


def json_dataset(pattern: str, where: str) -> Any:
    """A JSON-lines dataset (``json:PATH`` or a ``.jsonl``/``.json`` path; a glob, a compressed file or a URL that
    fsspec opens too), read exactly as written (:func:`exact_rows`).

    Raises:
        ConfigError: no such file, a folder, a line that is not a JSON object, or no rows at all.
    """
    files: list[Path] | list[str] = local_files(pattern, where, "JSON-lines") or [pattern]  # a URL: fsspec reads it
    rows = [row for path in files for row in json_rows(path, where)]
    if not rows:
        names = ", ".join(map(str, files))
        raise ConfigError(f"{where}: {names} holds no JSON object (an empty file?); {_JSON_FIX}")
    return exact_rows(rows)


def _datasets_loader(builder: str, pattern: str, where: str, **kwargs: Any) -> Any:
    import datasets

    loader_log = logging.getLogger(f"datasets.packaged_modules.{builder}.{builder}")
    level = loader_log.level
    loader_log.setLevel(logging.CRITICAL)
    try:
        with _quiet_datasets():
            return datasets.load_dataset(builder, data_files=pattern, split="train", **kwargs)
    except Exception as exc:  # noqa: BLE001 - pyarrow/datasets raise many types; each is reported as bad input
        cause = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        raise ConfigError(
            f"{where}: the datasets {builder} loader cannot read it ({type(exc).__name__}: {cause})"
        ) from None
    finally:
        loader_log.setLevel(level)


def _cast_cell(value: str | None, kind: str, column: str, index: int, where: str) -> Any:
    if value is None or kind == "str":
        return value
    try:
        if kind == "int":
            return int(value)
        if kind == "float":
            return float(value)
        if kind == "json":
            return json.loads(value)
        low = value.strip().lower()
        if low in ("true", "1", "yes"):
            return True
        if low in ("false", "0", "no"):
            return False
        raise ValueError(value)
    except ValueError:
        raise ConfigError(
            f"{where}: row {index}, column {column!r} is {value!r}, not a {kind} (column_types); fix the cell or "
            "the column's type"
        ) from None


def csv_dataset(pattern: str, where: str, column_types: dict[str, str]) -> Any:
    """A CSV (``.tsv``: tab-separated) dataset: every cell a string as written (``""`` for an empty one, no NA
    guessing), then the columns ``column_types`` names converted (``int``, ``float``, ``bool`` from
    true/false/1/0/yes/no, ``json``; ``str`` keeps the text).

    Raises:
        ConfigError: no such file, an unreadable file, no rows, a column of ``column_types`` the file lacks, or a
            cell that is not of its column's type (names the row and column).
    """
    import pandas as pd

    files = local_files(pattern, where, "CSV") or [pattern]
    frames = []
    for path in files:
        sep = "\t" if data_form(Path(path)) == "csv" and ".tsv" in Path(path).name.lower() else ","
        try:
            frames.append(pd.read_csv(path, dtype=str, keep_default_na=False, na_filter=False, sep=sep))
        except (OSError, ValueError, pd.errors.ParserError) as exc:
            raise ConfigError(f"{where}: {path} cannot be read as CSV ({exc})") from None
    rows = [row for frame in frames for row in frame.to_dict(orient="records")]
    if not rows:
        raise ConfigError(f"{where}: no rows (a header line and one line per row are needed)")
    missing = sorted(set(column_types) - set(rows[0]))
    if missing:
        raise ConfigError(f"{where}: column_types names {missing}, which the CSV lacks (columns: {sorted(rows[0])})")
    for index, row in enumerate(rows):
        for column, kind in column_types.items():
            row[column] = _cast_cell(row[column], kind, column, index, where)
    return exact_rows(rows)


def parquet_dataset(pattern: str, where: str) -> Any:
    """A Parquet dataset (a file, a glob or a URL), typed by the file's own schema."""
    local_files(pattern, where, "Parquet")
    return _datasets_loader("parquet", str(user_path(pattern)) if "://" not in pattern else pattern, where)


def arrow_dataset(pattern: str, where: str) -> Any:
    """An Arrow IPC file (stream or file format, as ``datasets`` writes it), typed by its schema."""
    import datasets

    files = local_files(pattern, where, "Arrow")
    if not files:  # a URL
        return _datasets_loader("arrow", pattern, where)
    try:
        parts = [datasets.Dataset.from_file(str(f), in_memory=True) for f in files]
    except Exception:  # noqa: BLE001 - one format of the two; the loader below reads the other or says why
        return _datasets_loader("arrow", pattern, where)
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def disk_dataset(folder: str, where: str, split: str) -> Any:
    """A folder saved with ``Dataset.save_to_disk`` (or a ``DatasetDict``'s, whose ``split`` is taken).

    Raises:
        ConfigError: no such folder, not a saved dataset, or a ``DatasetDict`` without ``split``.
    """
    import datasets

    path = user_path(folder)
    if not path.is_dir():
        raise ConfigError(f"{where}: no such folder {path.resolve()}; fix the path")
    try:
        data = datasets.load_from_disk(str(path))
    except FileNotFoundError as exc:
        raise ConfigError(
            f"{where}: {path} is not a folder saved with Dataset.save_to_disk ({exc}); for a "
            "folder of data files name the files ('PATH/*.parquet')"
        ) from None
    return _split(data, split, where)


def _split(data: Any, split: str, what: str) -> Any:
    import datasets

    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise ConfigError(f"{what} has no split {split!r} (splits: {sorted(data)}); set the split to one of them")
        return data[split]
    return data


def hub_dataset(repo_id: str, where: str, split: str) -> Any:
    """A Hub dataset ``owner/name`` (``owner/name/CONFIG`` for the files of one configuration's folder,
    ``...@revision``) from the local Hugging Face cache only: its snapshot's data files of ``split`` (the Hub's
    file-name conventions), read by their suffix as local files are. Nothing is downloaded.

    Raises:
        ConfigError: not in the cache (says where the cache is and how to fill it), no files of ``split``.
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    path, _, revision = repo_id.partition("@")
    name, subfolder = "/".join(path.split("/")[:2]), "/".join(path.split("/")[2:])
    try:
        folder = snapshot_download(name, repo_type="dataset", revision=revision or None, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError) as exc:
        raise ConfigError(
            f"{where}: the dataset is not in the local Hugging Face cache "
            f"({os.environ.get('HF_HUB_CACHE') or constants.HF_HUB_CACHE}; {type(exc).__name__}), and nothing is "
            f"downloaded at run time. Fetch it where there is network: `hf download {name} --repo-type dataset` "
            "(copy that cache here, or point HF_HUB_CACHE / HF_HOME at it), or save it to a file and name the file"
        ) from None
    if subfolder and not (Path(folder) / subfolder).is_dir():
        raise ConfigError(f"{where}: the cached snapshot {folder} has no folder {subfolder!r} (a configuration)")
    return _hub_split(Path(folder) / subfolder, where, split)


def folder_dataset(folder: Path, where: str, split: str) -> Any:
    """A local folder named as a path: one saved with ``Dataset.save_to_disk``, or a folder of data files whose
    ``split`` is told by their names as on the Hub (``train*.parquet``, ``data/train-*``; any data file is ``train``
    when no name says a split), read by their suffix.

    Raises:
        ConfigError: the folder holds no data file, mixes file forms or lacks ``split`` (names ``where``).
    """
    from datasets.data_files import EmptyDatasetError

    try:
        return _hub_split(folder, where, split)
    except EmptyDatasetError:
        raise ConfigError(
            f"{where}: the folder {folder.resolve()} holds no JSON-lines, Parquet, CSV or Arrow file and is no "
            "folder saved with Dataset.save_to_disk; fix the path"
        ) from None


def _hub_split(folder: Path, what: str, split: str) -> Any:
    import datasets
    from datasets.data_files import get_data_patterns

    if (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file():
        return _split(datasets.load_from_disk(str(folder)), split, what)
    patterns = {str(k): v for k, v in get_data_patterns(str(folder)).items()}
    if split not in patterns:
        raise ConfigError(f"{what} has no split {split!r} (splits: {sorted(patterns)}); set the split to one of them")
    files = sorted({Path(p) for pattern in patterns[split] for p in glob.glob(str(folder / pattern), recursive=True)})
    files = [f for f in files if f.is_file() and data_form(f)]
    if not files:
        raise ConfigError(f"{what}: split {split!r} has no JSON-lines, Parquet, CSV or Arrow file in {folder}")
    forms = {data_form(f) or "" for f in files}
    if len(forms) > 1:
        raise ConfigError(f"{what}: split {split!r} mixes file forms {sorted(forms)}; name the files instead")
    form = forms.pop()
    parts = [read_file(str(f), form, what, {}) for f in files]
    if len(parts) == 1:
        return parts[0]
    if all(isinstance(p, list) for p in parts):  # JSON lines and CSV read as lists of row dicts
        return [row for part in parts for row in part]
    return datasets.concatenate_datasets(parts)


def read_file(pattern: str, form: str, where: str, column_types: dict[str, str]) -> Any:
    """A dataset file of a known form (``json``, ``parquet``, ``csv``, ``arrow``)."""
    if form == "json":
        return json_dataset(pattern, where)
    if form == "csv":
        return csv_dataset(pattern, where, column_types)
    if form == "parquet":
        return parquet_dataset(pattern, where)
    return arrow_dataset(pattern, where)


def read_source(spec: str, where: str, split: str = "train", column_types: dict[str, str] | None = None) -> Any:
    """The rows of a data form of ``rollout.dataset`` (not ``reasoning_gym:`` or ``module:callable``): ``json:``,
    ``parquet:``, ``csv:``, ``arrow:``, ``disk:``, ``hf:`` or a plain path whose suffix (or saved folder) tells.

    Raises:
        ConfigError: the form cannot be told, or the reader's error (names ``where`` and the fix).
    """
    form, target = dataset_form(spec)
    types = column_types or {}
    if form == "disk":
        return disk_dataset(target, where, split)
    if form == "hf":
        return hub_dataset(target, where, split)
    if form == "path":
        path = user_path(target)
        hint = "" if path.exists() or glob.glob(str(path)) else unknown_prefix_hint(spec)
        if hint:  # 'hf2:owner/name', 'jsonl:data.jsonl': a mistyped prefix, not a missing file
            raise ConfigError(f"{where}: no such file or folder {path.resolve()}{hint}")
        if path.is_dir():
            return folder_dataset(path, where, split)
        if not path.exists() and not glob.has_magic(target) and not data_form(path):
            raise ConfigError(
                f"{where}: no such file or folder {path.resolve()}, and no 'module:callable' (which needs its ':'); "
                "name a local data file or a folder of data files, or a function returning the rows as "
                "'module:callable'"
            )
        form = data_form(path) or ""
        if not form:
            raise ConfigError(
                f"{where}: the suffix does not tell the file's form; write 'json:PATH', 'parquet:PATH', "
                "'csv:PATH' or 'arrow:PATH', or name a .jsonl/.json/.parquet/.csv/.tsv/.arrow file"
            )
    return read_file(target, form, where, types)
