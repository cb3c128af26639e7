"""Three ``epp serve`` replicas on one real Redis server, four simulated vLLM pods publishing
real KV events: every pod's stream is ingested by exactly one replica; a pod that restarts has
its entries cleared by its owner (and only its own); and when the owner of a pod is SIGKILLed,
another takes the pod over and catches up from its replay buffer, so a prompt the pod cached
right after the kill reaches the shared index."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import valkey

from launcher.configs import shared_store_config
from launcher.kv_store import KVStoreServer
from launcher.observe import blocks_in_store, cache_on_pod, owned_streams
from launcher.stack import MODEL, Stack

LEASE_S = 1.0
NAMESPACE = "e2e"


def _owned(stack: Stack, replica: int) -> set[str]:
    return owned_streams(stack.replicas[replica].metrics_url, [pod.address for pod in stack.pods])


def _cache(pod_address: str, ids: list[int]) -> None:
    cache_on_pod(pod_address, MODEL, ids)


def _held(client: valkey.Valkey, pod_address: str, ids: list[int]) -> bool:
    return all(blocks_in_store(client, NAMESPACE, pod_address, ids))


def _restart(pod_address: str) -> None:
    """The simulator's engine restart: its cache is emptied and its event stream starts again."""
    request = urllib.request.Request(
        f"http://{pod_address}/fault/restart",
        data=b"{}",
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


def _wait(condition: object, what: str, timeout: float = 30.0) -> float:
    started = time.monotonic()
    while not condition():  # type: ignore[operator]
        if time.monotonic() - started > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)
    return time.monotonic() - started


def test_replicas_share_the_pods_and_survive_a_killed_owner(
    tmp_path: Path, llama3_tokenizer_dir: Path
) -> None:
    with KVStoreServer(tmp_path) as server:
        config = shared_store_config(llama3_tokenizer_dir, server.address, NAMESPACE, LEASE_S)
        client = valkey.Valkey.from_url(server.address)
        with Stack.start(
            tmp_path, llama3_tokenizer_dir, pods=4, replicas=3, config=config
        ) as stack:
            pods = {pod.address for pod in stack.pods}

            def shared_out() -> bool:
                owned = [_owned(stack, r) for r in range(3)]
                return (
                    all(not owned[a] & owned[b] for a in range(3) for b in range(a + 1, 3))
                    and set().union(*owned) == pods
                )

            _wait(shared_out, "every pod owned by exactly one replica")
            for i, pod in enumerate(stack.pods):
                ids = [10_000 * (i + 1) + t for t in range(64)]
                _cache(pod.address, ids)
                _wait(lambda a=pod.address, p=ids: _held(client, a, p), f"pod {i}'s prompt")

            # A pod restarts (seen when its stream starts again at seq 0): its owner drops its
            # entries from the store, the other pods keep theirs, and what it caches afterwards
            # is written again.
            first = [[10_000 * (i + 1) + t for t in range(64)] for i in range(len(stack.pods))]
            restarted = stack.pods[0].address
            _restart(restarted)
            again = [50_000 + t for t in range(64)]
            _cache(restarted, again)
            _wait(lambda: _held(client, restarted, again), "a prompt cached after the restart")
            # Cleared: none of the pod's earlier blocks is left, only what it cached since.
            assert not any(blocks_in_store(client, NAMESPACE, restarted, first[0]))
            assert all(
                _held(client, pod.address, first[i]) for i, pod in enumerate(stack.pods) if i
            )

            victim = next(r for r in range(3) if _owned(stack, r))
            orphans = sorted(_owned(stack, victim))
            proc = stack.replicas[victim].proc
            assert proc is not None
            proc.kill()  # SIGKILL: no clean hand-over, the lease has to lapse
            proc.wait(10)
            killed = time.monotonic()
            # Cached while no replica ingests these pods' events.
            late = [[90_000 + 1_000 * n + t for t in range(64)] for n in range(len(orphans))]
            for address, ids in zip(orphans, late, strict=True):
                _cache(address, ids)
            survivors = [r for r in range(3) if r != victim]

            def taken_over() -> bool:
                return set().union(*(_owned(stack, r) for r in survivors)) == pods

            _wait(taken_over, "the killed replica's pods owned by the survivors")
            failover = time.monotonic() - killed
            for address, ids in zip(orphans, late, strict=True):
                _wait(lambda a=address, p=ids: _held(client, a, p), "the late prompts")
            caught_up = time.monotonic() - killed
            print(f"failover {failover:.2f} s, late prompts in the store after {caught_up:.2f} s")
            assert failover < 5.0 and caught_up < 10.0, (failover, caught_up)
            live = [m.decode() for m in client.zrange(f"{NAMESPACE}:replicas", 0, -1)]  # type: ignore[union-attr]
            assert len(live) == 2, live
        client.close()
