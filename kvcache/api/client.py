"""``epp kv``: a command-line client of the KV-cache gRPC API.

    epp kv score  --address HOST:PORT --model M (--text T | --chat-json J | --token-ids 1,2,...)
                  [--endpoint IP:PORT ...] [--cache-salt S] [--json]
    epp kv lookup --address HOST:PORT --keys K1,K2,... [--endpoint IP:PORT ...] [--json]
    epp kv health --address HOST:PORT

Prints a table per endpoint (or the response as JSON); exits 1 when the server answers with an
error (its message on stderr), 2 when the arguments are wrong.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvcache.api import kvcache_pb2 as pb
from kvcache.api import kvcache_pb2_grpc as pb_grpc
from kvcache.api.service import SERVICE_NAME


def add_parser(sub: Any) -> None:
    """The ``kv`` subcommand on ``epp``'s parser."""
    kv = sub.add_parser(
        "kv",
        help="ask a running EPP's KV-cache gRPC API",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verbs = kv.add_subparsers(dest="verb", required=True)
    score = verbs.add_parser("score", help="which pods hold how much of a prompt")
    lookup = verbs.add_parser("lookup", help="which pods hold how many leading block keys")
    health = verbs.add_parser("health", help="the API's gRPC health")
    for verb in (score, lookup, health):
        verb.add_argument("--address", required=True, help="host:port of --kv-cache-grpc-port")
        verb.add_argument("--timeout", type=float, default=5.0, help="seconds")
    for verb in (score, lookup):
        verb.add_argument(
            "--endpoint",
            action="append",
            default=[],
            help="ip:port to score (repeat); all by default",
        )
        verb.add_argument("--json", action="store_true", help="print the response as JSON")
    score.add_argument("--model", required=True)
    prompt = score.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--text", help="a completions prompt")
    prompt.add_argument("--chat-json", help="chat messages as a JSON list")
    prompt.add_argument("--token-ids", help="comma-separated prompt token ids")
    score.add_argument("--cache-salt", default="")
    lookup.add_argument("--keys", required=True, help="comma-separated 64-bit block keys")


def _ints(text: str, what: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SystemExit(f"epp kv: {what} must be comma-separated integers, got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    with grpc.insecure_channel(args.address) as channel:
        try:
            if args.verb == "health":
                stub = health_pb2_grpc.HealthStub(channel)
                status = stub.Check(
                    health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=args.timeout
                )
                print(health_pb2.HealthCheckResponse.ServingStatus.Name(status.status))
                return 0
            api = pb_grpc.KVCacheStub(channel)  # type: ignore[no-untyped-call]
            response: Any
            if args.verb == "score":
                request = pb.ScoreRequest(
                    model=args.model, cache_salt=args.cache_salt, endpoints=args.endpoint
                )
                if args.text is not None:
                    request.text = args.text
                elif args.chat_json is not None:
                    request.chat_json = args.chat_json
                else:
                    request.token_ids.ids.extend(_ints(args.token_ids, "--token-ids"))
                response = api.Score(request, timeout=args.timeout)
            else:
                response = api.Lookup(
                    pb.LookupRequest(
                        block_keys=_ints(args.keys, "--keys"), endpoints=args.endpoint
                    ),
                    timeout=args.timeout,
                )
        except grpc.RpcError as exc:
            print(f"epp kv: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(MessageToDict(response, always_print_fields_with_no_presence=True)))
        return 0
    if args.verb == "score":
        print(
            f"{response.prompt_tokens} prompt tokens, {response.total_blocks} full blocks of "
            f"{response.block_size}"
        )
    print(f"{'endpoint':24} {'matched':>8} {'weighted':>9} {'score':>7} {'held':>8}")
    for pod in response.pods:
        print(
            f"{pod.endpoint:24} {pod.matched_blocks:8} {pod.weighted:9.2f} {pod.score:7.3f} "
            f"{pod.held_blocks:8}"
        )
    return 0
