"""``kv_transfer_params`` as vLLM's NixlConnector reads and answers them (disaggregated serving).

The routing sidecar beside a decode pod sends the prompt to the prefill pod first with
``{"do_remote_decode": true}`` and one output token; that pod computes the prompt's KV and answers
with the parameters a decoder needs to pull it (``remote_engine_id``, ``remote_block_ids``,
``remote_host``, ``remote_port``, ...).  The sidecar passes them verbatim to its own decode pod
with the original request, which pulls the KV and decodes.

The simulator moves no bytes: the decode pod's engine waits the time the pull would take
(`simulator.engine.Engine.add_request`'s ``remote_prefill``) and then holds the blocks as if
copied.  It does not check that the named prefill pod holds them (vLLM would fail the pull and
recompute), and a prefill pod frees its blocks when its one-token request finishes instead of
keeping them until the decoder has read them.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from simulator.server_config import SimulatorError

_PULL_FIELDS: Final = ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port")

Leg = Literal["prefill", "decode"]


class TransferError(ValueError):
    """``kv_transfer_params`` this pod cannot honour (HTTP 400)."""


@dataclass(slots=True, frozen=True)
class KVTransferSide:
    """What this pod answers a prefill leg with: its engine id and where decoders pull from."""

    connector: str  # "<connector>/<role>" from --kv-transfer-config
    host: str
    side_channel_port: int = 5600  # VLLM_NIXL_SIDE_CHANNEL_PORT's default
    engine_id: str = ""

    def __post_init__(self) -> None:
        if not self.engine_id:
            object.__setattr__(self, "engine_id", str(uuid.uuid4()))

    @property
    def role(self) -> str:
        return self.connector.rpartition("/")[2]

    def leg(self, params: Mapping[str, Any] | None, *, stream: bool) -> Leg | None:
        """Which leg of a P/D request this is: "prefill" (compute for a remote decoder),
        "decode" (pull a remote prefill), or None (an ordinary request).  Raises
        `TransferError` for parameters this pod cannot serve."""
        if params is None:
            return None
        if not isinstance(params, Mapping):
            raise TransferError("kv_transfer_params must be an object")
        if params.get("do_remote_decode"):
            if self.role == "kv_consumer":
                raise TransferError(
                    "kv_transfer_params.do_remote_decode: this pod's kv_role is kv_consumer; "
                    "it only decodes from a remote prefill"
                )
            if stream:
                raise TransferError(
                    "kv_transfer_params.do_remote_decode with stream: the prefill leg answers "
                    "its kv_transfer_params in one JSON response; send it with stream false"
                )
            return "prefill"
        if params.get("do_remote_prefill"):
            if self.role == "kv_producer":
                raise TransferError(
                    "kv_transfer_params.do_remote_prefill: this pod's kv_role is kv_producer; "
                    "it only prefills for remote decoders"
                )
            missing = [f for f in _PULL_FIELDS if params.get(f) is None]
            if missing:
                raise TransferError(
                    f"kv_transfer_params.do_remote_prefill needs {', '.join(missing)} (the "
                    "prefill pod's answer, passed on verbatim)"
                )
            return "decode"
        return None

    def prefill_answer(
        self, request_id: str, prompt_tokens: int, block_size: int
    ) -> dict[str, Any]:
        """The parameters a prefill leg's response carries, as NixlConnector's
        ``request_finished`` returns them."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": list(range(1, -(-prompt_tokens // block_size) + 1)),
            "remote_engine_id": self.engine_id,
            "remote_request_id": request_id,
            "remote_host": self.host,
            "remote_port": self.side_channel_port,
            "tp_size": 1,
            "remote_num_tokens": prompt_tokens,
        }


def transfer_side(connector: str | None, host: str) -> KVTransferSide | None:
    if connector is None:
        return None
    if "/" not in connector:
        raise SimulatorError(f"kv connector {connector!r}: expected '<connector>/<role>'")
    return KVTransferSide(connector=connector, host=host)
