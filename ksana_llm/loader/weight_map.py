"""KsanaLLM weight-name maps: `<model_type>_weight_map.json`, checkpoint names -> our (Llama) names.

A map is a flat JSON object `{"<regex>": "<replacement>"}`. KsanaLLM applies it per tensor name
like this (`GetCustomNameList`), and so do we:
- the entries are tried in order; the first whose regex is *found* in the name wins (no chaining);
- that entry's regex is replaced everywhere in the name, `std::regex_replace` style: `$1`..`$99`
  are groups, `$&` (or `$0`) the whole match, `` $` `` / `$'` the text before / after it, `$$` a
  dollar; anything else (backslashes included) is literal;
- the value `"deprecated"` drops the tensor (vision towers and the like);
- a name no entry matches passes through unchanged (names Llama already uses need no entry).
Order: KsanaLLM's nlohmann::json reads objects into a sorted map, so its "order" is the keys'
sort order; we use the file's order, which is what a person writing the file expects. Maps whose
patterns overlap should not depend on either.

The file is looked up in the model folder first, then in the package's `weight_maps/` folder.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

LOGGER = logging.getLogger("ksana_llm.loader")

WEIGHT_MAP_SUFFIX = "_weight_map.json"
DEPRECATED = "deprecated"
PACKAGE_WEIGHT_MAP_DIR = Path(__file__).resolve().parent / "weight_maps"

# One `$` escape of a std::regex_replace format string: `$$`, `$&`, `` $` ``, `$'`, or 1-2 digits.
_FORMAT_ESCAPE = re.compile(r"\$(\$|&|`|'|\d{1,2})")

# A parsed replacement: literal strings and references (group number, or "`" / "'" for the
# prefix / suffix of the match).
_Piece = str | int


def weight_map_filename(model_type: str) -> str:
    return f"{model_type}{WEIGHT_MAP_SUFFIX}"


def _parse_format(fmt: str) -> tuple[list[tuple[bool, _Piece]], int]:
    """Split a replacement into (is_reference, piece) items; also return the highest group used."""
    pieces: list[tuple[bool, _Piece]] = []
    highest = 0
    last = 0
    for escape in _FORMAT_ESCAPE.finditer(fmt):
        pieces.append((False, fmt[last:escape.start()]))
        token = escape.group(1)
        if token == "$":
            pieces.append((False, "$"))
        elif token == "&":
            pieces.append((True, 0))
        elif token in ("`", "'"):
            pieces.append((True, token))
        else:  # like libstdc++: two digits are read greedily when present
            pieces.append((True, int(token)))
            highest = max(highest, int(token))
        last = escape.end()
    pieces.append((False, fmt[last:]))
    return [p for p in pieces if p[0] or p[1]], highest


@dataclass(frozen=True)
class WeightMapEntry:
    """One `"<regex>": "<replacement>"` line; `replacement` None means "deprecated" (drop)."""

    key: str
    pattern: re.Pattern[str]
    replacement: str | None
    pieces: tuple[tuple[bool, _Piece], ...] = ()

    def _expand(self, match: re.Match[str]) -> str:
        out = []
        for is_ref, piece in self.pieces:
            if not is_ref:
                out.append(piece)
            elif piece == "`":
                out.append(match.string[:match.start()])
            elif piece == "'":
                out.append(match.string[match.end():])
            else:
                out.append(match.group(piece) or "")  # an unmatched optional group is empty
        return "".join(out)

    def rename(self, name: str) -> str | None:
        """The new name (every match replaced), or None to drop; call only when it matches."""
        if self.replacement is None:
            return None
        return self.pattern.sub(self._expand, name)


@dataclass(frozen=True)
class WeightMap:
    """A loaded map: apply it to checkpoint names with `map_name` or to a tensor stream with `apply`."""

    source: str  # the file it came from (for messages)
    entries: tuple[WeightMapEntry, ...]

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, str], source: str = "<weight map>") -> WeightMap:
        """Compile `{regex: replacement}`; ValueError naming `source` and the key on a bad entry."""
        if not isinstance(mapping, Mapping):
            raise ValueError(f"weight map {source} must be a JSON object of {{regex: replacement}}, "
                             f"got {type(mapping).__name__}")
        entries = []
        for key, value in mapping.items():
            if not isinstance(value, str):
                raise ValueError(f"weight map {source}: the value of {key!r} must be a string "
                                 f"(a replacement or \"{DEPRECATED}\"), got {value!r}")
            try:
                pattern = re.compile(key)
            except re.error as exc:
                raise ValueError(f"weight map {source}: key {key!r} is not a valid regex ({exc})") from exc
            if value == DEPRECATED:
                entries.append(WeightMapEntry(key, pattern, None))
                continue
            pieces, highest = _parse_format(value)
            if highest > pattern.groups:
                raise ValueError(f"weight map {source}: the replacement of {key!r} uses ${highest}, "
                                 f"but the regex has {pattern.groups} group(s)")
            entries.append(WeightMapEntry(key, pattern, value, tuple(pieces)))
        return cls(source, tuple(entries))

    def map_name(self, name: str) -> str | None:
        """The name our model knows this tensor by, or None when the map drops it."""
        for entry in self.entries:
            if entry.pattern.search(name):
                return entry.rename(name)
        return name

    def apply(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Rename a `(name, tensor)` stream lazily; dropped tensors are skipped. Two checkpoint
        tensors landing on one name is a broken map, and would silently keep only the second:
        ValueError naming both."""
        origin: dict[str, str] = {}
        dropped = 0
        for name, tensor in weights:
            new_name = self.map_name(name)
            if new_name is None:
                dropped += 1
                continue
            if new_name in origin:
                raise ValueError(f"weight map {self.source}: checkpoint tensors {origin[new_name]!r} "
                                 f"and {name!r} both map to {new_name!r}")
            origin[new_name] = name
            yield new_name, tensor
        LOGGER.info("weight map %s: %d tensors renamed or kept, %d dropped as deprecated",
                    self.source, len(origin), dropped)


def load_weight_map(path: str | os.PathLike[str]) -> WeightMap:
    """Read and compile one map file; ValueError naming the file (and key) when it is malformed."""
    file = Path(path)
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"weight map {file} is not valid JSON ({exc})") from exc
    return WeightMap.from_mapping(data, str(file))


def find_weight_map(model_dir: str | os.PathLike[str] | None, model_type: str | None, *,
                    package_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """`<model_dir>/<model_type>_weight_map.json`, else the one in `package_dir` (default: the
    package's own `weight_maps/`), else None."""
    if not model_type:
        return None
    # Also in lower case: Yi's original configs say "Yi", its map is the package's "yi" one.
    names = dict.fromkeys([weight_map_filename(model_type), weight_map_filename(model_type.lower())])
    folders = [] if model_dir is None else [Path(model_dir)]
    folders.append(PACKAGE_WEIGHT_MAP_DIR if package_dir is None else Path(package_dir))
    for folder in folders:
        for name in names:
            candidate = folder / name
            if candidate.is_file():
                return candidate
    return None


def weight_map_for(model_dir: str | os.PathLike[str] | None, model_type: str | None, *,
                   package_dir: str | os.PathLike[str] | None = None) -> WeightMap | None:
    """The compiled map that applies to a model folder of this `model_type`, or None."""
    path = find_weight_map(model_dir, model_type, package_dir=package_dir)
    if path is None:
        return None
    LOGGER.info("using weight map %s", path)
    return load_weight_map(path)
