"""`tests/data/generate_vllm_vectors.py` run with the real vLLM of `.venv-vllm`: its output has
the format the golden-vector tests read (same loader, same keys and value types in every case),
and the installed vLLM computes exactly the committed vectors for every case both define.

The event batch is compared decoded, not byte for byte: msgspec writes a struct's map header
as fixmap or map16 depending on how many fields the struct *declares*, so the same events
encode differently across vLLM versions (vLLM 0.32's BlockStored: fixmap; 0.33's, which has
more fields: map16).

One run of the script serves all tests: about 10 s, nearly all of it importing vLLM.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import xxhash

from launcher.vllm import VLLM_PYTHON, VLLM_VENV
from tests import conftest

pytestmark = pytest.mark.slow

SCRIPT = conftest.PROJECT_ROOT / "tests" / "data" / "generate_vllm_vectors.py"


def script_env(workdir: Path) -> dict[str, str]:
    """The script's environment.  vLLM's xxhash algorithms need the optional `xxhash` package,
    which `make vllm-env` does not install; when `.venv-vllm` lacks it, the script gets this
    interpreter's copy (both venvs come from the same CPython) through PYTHONPATH, alone in a
    directory so that nothing else of this venv shadows vLLM's dependencies."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if not any(VLLM_VENV.glob("lib/python3*/site-packages/xxhash/__init__.py")):
        only_xxhash = workdir / "xxhash-only"
        only_xxhash.mkdir()
        (only_xxhash / "xxhash").symlink_to(Path(xxhash.__file__).parent)
        env["PYTHONPATH"] = str(only_xxhash)
    return env


@pytest.fixture(scope="module")
def regenerated(vllm_env: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    workdir = tmp_path_factory.mktemp("regenerated-vectors")
    out = workdir / "vectors.json"
    result = subprocess.run(
        [str(VLLM_PYTHON), str(SCRIPT), "--out", str(out)],
        cwd=conftest.PROJECT_ROOT,
        env=script_env(workdir),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, (
        f"{SCRIPT.name} exited with {result.returncode}:\n"
        f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    # Read back by the very loader the `vectors` fixture uses, pointed at the new file only
    # for this call (the session's `vectors` fixture must still load the committed file).
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(conftest, "VECTORS_FILE", out)
        return conftest.load_vectors()


def shape(value: Any) -> Any:
    """The JSON structure with every leaf replaced by its type name."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(v) for v in value]
    return type(value).__name__


def carried_over_ids(data: dict[str, Any]) -> set[str]:
    return set(data["provenance"]["carried_over"]["hash_vectors"]["ids"])


def test_output_has_the_committed_format(
    regenerated: dict[str, Any], vectors: dict[str, Any]
) -> None:
    assert list(regenerated) == list(vectors)
    assert regenerated["field_legend"].keys() == vectors["field_legend"].keys()
    assert shape(regenerated["token_sequences"]) == shape(vectors["token_sequences"])
    assert [v["id"] for v in regenerated["hash_vectors"]] == [
        v["id"] for v in vectors["hash_vectors"]
    ]
    for new, old in zip(regenerated["hash_vectors"], vectors["hash_vectors"], strict=True):
        assert shape(new) == shape(old), new["id"]
    assert shape(regenerated["legacy_hash_vectors"]) == shape(vectors["legacy_hash_vectors"])
    assert shape(regenerated["kv_events"]) == shape(vectors["kv_events"])
    provenance = regenerated["provenance"]
    assert provenance["vllm_version"]
    assert {"cbor2", "msgspec", "xxhash", "pyzmq"} <= provenance["libs"].keys()
    assert provenance["generated_at"]


def test_every_computed_vector_equals_the_committed_one(
    regenerated: dict[str, Any], vectors: dict[str, Any]
) -> None:
    carried = carried_over_ids(regenerated)
    # vLLM 0.32 has no lookahead hashing: those vectors (only) are copied, not recomputed.
    assert carried and all("lookahead" in vid for vid in carried)
    committed = {v["id"]: v for v in vectors["hash_vectors"]}
    computed = [v for v in regenerated["hash_vectors"] if v["id"] not in carried]
    assert len(computed) == len(committed) - len(carried) == 84
    for vector in computed:
        assert vector == committed[vector["id"]], vector["id"]


def test_event_batch_decodes_to_the_committed_events(
    regenerated: dict[str, Any], vectors: dict[str, Any]
) -> None:
    new, old = regenerated["kv_events"], vectors["kv_events"]
    for key in ("event_types", "payload_decoded_generic_msgpack"):
        assert new["combined_batch"][key] == old["combined_batch"][key], key
    assert new["request_A_block_hashes_hex"] == old["request_A_block_hashes_hex"]
    assert new["request_B_block_hashes_hex"] == old["request_B_block_hashes_hex"]
