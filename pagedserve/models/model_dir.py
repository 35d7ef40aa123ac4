"""What a model directory holds, and whether it can be read: the files that make it up, and a
check of each before anything is loaded or spawned.

A damaged directory (a config.json that is not JSON or lacks a field, a weights file cut short by
a partial copy or download) is a ``ModelDirError``: one line naming the file, what is wrong with
it and what to do, as vLLM names the file and the field. ``check_weights`` reads only the headers
of the weight files (and ``load_config`` only config.json), so ``serve`` runs both in the HTTP
process before it starts the engine core (``engine/start_checks.py``), in well under a second for
any checkpoint. No torch here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

COPY_AGAIN = "copy or download it again from the checkpoint"


class ModelDirError(ValueError):
    """A file of a model directory that cannot be used: ``path: problem; fix``."""

    def __init__(self, path: Path, problem: str, fix: str = COPY_AGAIN):
        super().__init__(f"{path}: {problem}; {fix}")
        self.path, self.problem, self.fix = path, problem, fix


def read_json(path: Path, fix: str = COPY_AGAIN) -> Any:
    """The JSON in ``path``; a ``ModelDirError`` where the file is not JSON."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        where = f"line {e.lineno}, column {e.colno}"
        raise ModelDirError(path, f"not valid JSON ({e.msg} at {where})", fix) from None
    except UnicodeDecodeError:
        raise ModelDirError(path, "not valid JSON (not UTF-8 text)", fix) from None


def read_json_object(path: Path, fix: str = COPY_AGAIN) -> dict[str, Any]:
    d = read_json(path, fix)
    if not isinstance(d, dict):
        raise ModelDirError(path, f"holds a JSON {type(d).__name__}, not an object", fix)
    return d


def weight_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's weight files: the shards its index lists, else ``*.safetensors``, else
    ``pytorch_model*.bin``."""
    model_dir = Path(model_dir)
    for index_name, pattern in (
        ("model.safetensors.index.json", "*.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model*.bin"),
    ):
        index = model_dir / index_name
        if index.is_file():
            return _files_from_index(index)
        files = sorted(model_dir.glob(pattern))
        if files:
            return files
    raise FileNotFoundError(
        f"no weights in {model_dir}: expected model.safetensors, sharded *.safetensors with "
        f"model.safetensors.index.json, or pytorch_model.bin"
    )


def _files_from_index(index: Path) -> list[Path]:
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ModelDirError(index, "has no 'weight_map' object naming each tensor's shard")
    files = [index.parent / name for name in sorted(set(map(str, weight_map.values())))]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(
            f"{index.name} lists shards that are not in {index.parent}: {missing}"
        )
    return files


def check_safetensors(path: Path) -> None:
    """A ``ModelDirError`` unless ``path`` holds a whole safetensors file: an 8-byte header
    length, a JSON header, and every tensor's bytes (a file cut short fails here, not halfway
    through loading)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        header_len = int.from_bytes(head, "little") if len(head) == 8 else None
        if header_len is None or header_len > size - 8:
            raise _truncated(path, f"it holds {size:,} bytes, not even its whole header")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ModelDirError(path, "not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise ModelDirError(path, "not a safetensors file (its header is not a JSON object)")
    ends = [_data_end(path, v) for k, v in header.items() if k != "__metadata__"]
    needed = 8 + header_len + max(ends, default=0)
    if needed > size:
        raise _truncated(path, f"it holds {size:,} of the {needed:,} bytes its header describes")


def _data_end(path: Path, entry: Any) -> int:
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if not (
        isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
    ):
        raise ModelDirError(path, "not a safetensors file (a tensor without its data_offsets)")
    return offsets[1]


def _truncated(path: Path, what: str) -> ModelDirError:
    return ModelDirError(path, f"truncated: {what} (a copy or download stopped part way)")


def check_weights(model_dir: str | Path) -> None:
    """Every safetensors weight file whole (``check_safetensors``)."""
    for path in weight_files(model_dir):
        if path.suffix == ".safetensors":
            check_safetensors(path)


def resolve_model_path(model: str) -> Path:
    """``--model``'s directory: the embedded demo model's for ``demo``, else the path given."""
    from pagedserve.presets import DEMO_MODEL, demo_model_dir

    if model == DEMO_MODEL:
        path = demo_model_dir()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"the embedded demo model is missing from {path}")
        return path
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"--model {model!r} is not a model directory (no config.json there); pass a local "
            f"Hugging Face directory or 'demo' (nothing is downloaded)"
        )
    return path
