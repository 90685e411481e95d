"""pooling.py: how an embedding model's folder turns hidden states into one vector a text, as sentence-transformers
saves it: modules.json lists the modules in order (the decoder, then 1_Pooling/config.json's pooling, then
optionally 2_Normalize); sentence_bert_config.json caps a text's tokens; config_sentence_transformers.json names the
prompts put before a text (Qwen3-Embedding's "query": an instruction). A module this engine does not run (a Dense
projection, ...) is refused in one line. A GGUF file says its pooling in `{arch}.pooling_type`, as llama.cpp reads it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from dense_engine.formats.checkpoint import read_json
from dense_engine.system.errors import CheckpointError, first_line

KINDS = {"pooling_mode_lasttoken": "lasttoken", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
MODULES = {"sentence_transformers.models.Transformer": "decoder", "sentence_transformers.models.Pooling": "pooling",
           "sentence_transformers.models.Normalize": "normalize"}


@dataclass(frozen=True)
class Pooling:
    kind: str  # "lasttoken" (the last token's hidden state), "mean" (over the text's tokens), "cls" (the first's)
    normalize: bool = False  # to unit length (2_Normalize)
    max_tokens: int | None = None  # a longer text is cut there, as sentence-transformers cuts it
    prompts: dict = field(default_factory=dict)  # name -> text put before the input (prompt_name)
    default_prompt: str | None = None  # the name of the prompt used when a request names none


GGUF_POOLING = {1: "mean", 2: "cls", 3: "lasttoken"}  # llama.cpp's pooling_type (0: none; 4: rank, a classifier)


def read_pooling(folder: str) -> Pooling | None:
    """The folder's (or GGUF file's) pooling, or None when it is not an embedding model's (no modules.json)."""
    if folder.endswith(".gguf") and os.path.isfile(folder):
        return gguf_pooling(folder)
    path = os.path.join(folder, "modules.json")
    if not os.path.isdir(folder) or not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            modules = json.load(f)  # (a list: read_json reads objects)
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: not readable JSON ({first_line(e)})") from None
    kinds = [MODULES.get(m.get("type")) if isinstance(m, dict) else None for m in modules] if isinstance(
        modules, list) else [None]
    if None in kinds or kinds[:2] != ["decoder", "pooling"] or kinds[2:] not in ([], ["normalize"]):
        raise CheckpointError(f"{path}: expected the modules Transformer, Pooling and optionally Normalize, got "
                              f"{[m.get('type') if isinstance(m, dict) else m for m in modules]}")
    pooling_file = os.path.join(folder, modules[1].get("path", ""), "config.json")
    config = read_json(pooling_file) if os.path.isfile(pooling_file) else {}
    on = [key for key, value in config.items() if key.startswith("pooling_mode_") and value]
    if len(on) != 1 or on[0] not in KINDS:
        raise CheckpointError(f"{pooling_file}: expected one of {', '.join(KINDS)} true, got {on or 'none'}")
    if config.get("include_prompt", True) is not True:
        raise CheckpointError(f"{pooling_file}: include_prompt false (a prompt left out of the pooling) is not "
                              "supported")
    bert = os.path.join(folder, "sentence_bert_config.json")
    max_tokens = read_json(bert).get("max_seq_length") if os.path.isfile(bert) else None
    named = os.path.join(folder, "config_sentence_transformers.json")
    named = read_json(named) if os.path.isfile(named) else {}
    prompts = {k: v for k, v in (named.get("prompts") or {}).items() if isinstance(v, str)}
    default = named.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise CheckpointError(f"{folder}: config_sentence_transformers.json's default_prompt_name {default!r} is not "
                              "one of its prompts")
    return Pooling(KINDS[on[0]], kinds[2:] == ["normalize"], int(max_tokens) if max_tokens else None, prompts,
                   default)


def gguf_pooling(path: str) -> Pooling | None:
    """A GGUF file's {arch}.pooling_type (None where absent or none), normalized as llama-server's embeddings are."""
    from dense_engine.formats import gguf_import

    reader = gguf_import.open_gguf(path)
    arch = gguf_import.field(reader, "general.architecture", path=path)
    kind = gguf_import.field(reader, f"{arch}.pooling_type", 0, path)
    if not kind:
        return None
    if kind not in GGUF_POOLING:
        raise CheckpointError(f"{path}: GGUF metadata {arch}.pooling_type {kind}: mean (1), cls (2) and last (3) are "
                              "supported (rank, 4, a classifier head, is not)")
    return Pooling(GGUF_POOLING[kind], normalize=True)
