"""The Helm chart (deploy/helm/kv-epp), rendered by real Helm in several value combinations.

Each combination must: pass ``helm lint --strict``; validate with ``kubernetes-validate --strict``
(built-in kinds) and our own schemas (InferencePool, ServiceMonitor); give an
EndpointPickerConfig that the EPP's own loader accepts and builds a scheduler from, with precise
scorer settings equal to the model-server values; give ``epp serve`` arguments its parser
accepts; and, with Envoy, an Envoy config that ``envoy --mode validate`` accepts and that equals
what ``epp.envoy_bootstrap.render_envoy_config`` renders.  NOTES.txt must print vLLM flags that
agree with all of it.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
import yaml

from epp.cli import build_parser, check_config
from epp.config import DEFAULT_CONFIG_YAML, load_config
from epp.envoy_bootstrap import render_envoy_config, validate_config
from indexer.hashing import HASH_ALGOS
from tests.deploy.chart import CHART_DIR, NAMESPACE, RELEASE, Helm, Rendered, vllm_flags
from tests.deploy.custom_resources import INFERENCE_POOL_V1, SERVICE_MONITOR_V1

FULLNAME = f"{RELEASE}-kv-epp"
CHART_VALUES: dict[str, Any] = yaml.safe_load((CHART_DIR / "values.yaml").read_text())

# name → values (merged over the chart's defaults by Helm)
VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "replicas-3": {"replicas": 3},
    "inference-pool": {
        "inferencePool": {"create": True, "failureMode": "FailOpen"},
        "modelServers": {
            "matchLabels": {"app": "vllm-llama3", "tier": "gpu"},
            "targetPorts": [8000, 8001],
            "modelName": "meta-llama/Llama-3.1-8B-Instruct",
        },
        # Two data-parallel ranks: the replay ports (5657+) must not meet the events' (5557+).
        "vllm": {"kvEventsReplayPort": 5657},
    },
    "monitoring": {
        "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        "dashboard": {"enabled": True},
    },
    "envoy": {"envoy": {"enabled": True}},
    "envoy-buffered-tls": {
        "envoy": {
            "enabled": True,
            "requestBodyMode": "BUFFERED",
            "failureModeAllow": True,
            "extProcHealthCheckIntervalSeconds": None,
            "messageTimeoutSeconds": 30,
        },
        "maxBodyBytes": 8388608,
        "tls": {"enabled": True, "secretName": "epp-tls"},
    },
    "custom-weights": {
        "scheduling": {
            "plugins": [
                {"type": "decode-filter"},
                {"name": "prefix", "type": "precise-prefix-cache-scorer", "weight": 4},
                {"type": "queue-scorer", "weight": 1.5},
                {"type": "kv-cache-utilization-scorer", "weight": 2},
                {"type": "active-request-scorer"},
                {"type": "weighted-random-picker"},
                {"type": "single-profile-handler", "inProfile": False},
            ],
            # Overrides by name win over the plugins' own weights.
            "weights": {"prefix": 5, "kv-cache-utilization-scorer": 0},
        }
    },
    "tokenizer-volume": {
        "tokenizer": {
            "volume": {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}},
            "path": "llama-3.1-8b",
            "models": {"mistral-7b": "mistral-7b", "qwen": "/opt/qwen"},
            "initContainers": [
                {
                    "name": "fetch",
                    "image": "busybox:1.36",
                    "command": ["sh", "-c", "ls /tokenizers"],
                    "volumeMounts": [{"name": "tokenizers", "mountPath": "/tokenizers"}],
                }
            ],
        }
    },
    "central-events": {"kvEvents": {"mode": "central"}, "vllm": {"kvEventsPort": 6557}},
    "vllm-defaults": {
        "vllm": {
            "blockSize": None,
            "hashAlgo": "sha256",
            "pythonHashSeed": None,
            "kvEventsReplayPort": None,
        }
    },
    "config-text": {
        "scheduling": {
            "configText": (
                "apiVersion: llm-d.ai/v1alpha1\n"
                "kind: EndpointPickerConfig\n"
                "plugins:\n"
                "- type: queue-scorer\n"
                "- type: round-robin-picker\n"
                "schedulingProfiles:\n"
                "- name: default\n"
                "  plugins:\n"
                "  - pluginRef: queue-scorer\n"
                "  - pluginRef: round-robin-picker\n"
            )
        }
    },
    "kv-store": {
        "replicas": 2,
        "kvStore": {"valkey": {"enabled": True}},
        "ports": {"kvCacheApi": 9004},
    },
    "everything": {
        "replicas": 2,
        "inferencePool": {"create": True},
        "serviceMonitor": {"enabled": True},
        "dashboard": {"enabled": True},
        "envoy": {"enabled": True, "replicas": 2, "extProcHealthCheckIntervalSeconds": 0.5},
        "tls": {"enabled": True},
        "tokenizer": {"volume": {"emptyDir": {}}},
        "flags": {"refresh-metrics-interval": "100ms", "tokenizer-workers": 4},
        "extraArgs": ["--saturation-staleness=500ms"],
        "admission": {"maxInFlightPerEndpoint": 8, "mode": "queue", "maxQueueWaitSeconds": 2.5},
        "vllm": {"blockSize": 32, "hashAlgo": "xxhash_cbor", "pythonHashSeed": 42},
    },
}
ENVOY_VARIANTS = [
    name for name, values in VARIANTS.items() if values.get("envoy", {}).get("enabled")
]


def effective(values: dict[str, Any]) -> dict[str, Any]:
    """The chart's defaults with ``values`` merged over them, as Helm merges (maps recursively,
    lists replaced, null deletes a key)."""

    def merge(base: Any, override: Any) -> Any:
        if isinstance(base, dict) and isinstance(override, dict):
            merged = dict(base)
            for key, value in override.items():
                merged[key] = merge(base.get(key), value) if value is not None else None
            return merged
        return override

    result: dict[str, Any] = merge(CHART_VALUES, values)
    return result


@pytest.fixture(scope="module")
def rendered(helm: Helm) -> dict[str, Rendered]:
    return {name: helm.template(values) for name, values in VARIANTS.items()}


def epp_args(r: Rendered) -> list[str]:
    args: list[str] = r.epp_container()["args"]
    return args


def precise_parameters(config_text: str) -> dict[str, Any] | None:
    config = load_config(text=config_text)
    for spec in config.plugins:
        if spec.type == "precise-prefix-cache-scorer":
            return spec.parameters
    return None


# ---------------------------------------------------------------------------------------------
# Helm and Kubernetes validity


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_helm_lint_strict(helm: Helm, variant: str) -> None:
    result = helm.lint(VARIANTS[variant])
    assert "0 chart(s) failed" in result.stdout, result.stdout


@pytest.mark.parametrize("kube_version", ["1.27.0", "1.35.0"])
def test_built_in_kinds_pass_kubernetes_validate_strict(
    rendered: dict[str, Rendered], tmp_path: Path, kube_version: str
) -> None:
    """Every variant's output through the real ``kubernetes-validate --strict`` CLI, against the
    oldest Kubernetes the chart supports (gRPC probes: 1.27) and a current one."""
    files = []
    for name, r in rendered.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(r.text)
        files.append(str(path))
    cli = Path(sys.executable).with_name("kubernetes-validate")
    result = subprocess.run(
        [str(cli), "--strict", "-k", kube_version, *files],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    passed = len(re.findall(r"^INFO .* passed for resource", output, re.M))
    built_in = sum(
        1
        for r in rendered.values()
        for d in r.docs
        if d["kind"] not in ("InferencePool", "ServiceMonitor")
    )
    assert passed == built_in, output
    for line in output.splitlines():
        if line.startswith("WARN"):
            assert re.search(r"schema for kind (InferencePool|ServiceMonitor) ", line), line


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_custom_resources_match_their_api_schemas(
    rendered: dict[str, Rendered], variant: str
) -> None:
    r = rendered[variant]
    for pool in r.all("InferencePool"):
        jsonschema.validate(pool, INFERENCE_POOL_V1)
    for monitor in r.all("ServiceMonitor"):
        jsonschema.validate(monitor, SERVICE_MONITOR_V1)


def test_optional_objects_follow_their_switches(rendered: dict[str, Rendered]) -> None:
    base = ["ConfigMap", "Deployment", "Role", "RoleBinding", "Service", "ServiceAccount"]
    assert rendered["defaults"].kinds() == base
    assert rendered["replicas-3"].kinds() == sorted([*base, "PodDisruptionBudget"])
    assert rendered["inference-pool"].kinds() == sorted([*base, "InferencePool"])
    assert rendered["monitoring"].kinds() == sorted([*base, "ConfigMap", "ServiceMonitor"])
    # Envoy: its ConfigMap, Deployment and Service, plus the EPP's headless ext_proc Service.
    assert rendered["envoy"].kinds() == sorted(
        [*base, "ConfigMap", "Deployment", "Service", "Service"]
    )


def test_inference_pool_selects_the_model_servers_and_points_at_the_epp(
    rendered: dict[str, Rendered],
) -> None:
    r = rendered["inference-pool"]
    pool = r.get("InferencePool", FULLNAME)
    assert pool["metadata"]["namespace"] == NAMESPACE
    assert pool["spec"]["selector"]["matchLabels"] == {"app": "vllm-llama3", "tier": "gpu"}
    assert pool["spec"]["targetPorts"] == [{"number": 8000}, {"number": 8001}]
    assert pool["spec"]["endpointPickerRef"] == {
        "kind": "Service",
        "name": FULLNAME,
        "port": {"number": 9002},
        "failureMode": "FailOpen",
    }
    service = r.get("Service", FULLNAME)
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {
        "grpc": 9002,
        "grpc-health": 9003,
        "metrics": 9090,
    }
    args = build_parser().parse_args(epp_args(r))
    assert (args.pool_name, args.pool_namespace, args.pool_group) == (
        FULLNAME,
        NAMESPACE,
        "inference.networking.k8s.io",
    )


def test_rbac_grants_read_access_to_pods_pools_and_rules_only(
    rendered: dict[str, Rendered],
) -> None:
    r = rendered["defaults"]
    role = r.get("Role", FULLNAME)
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {
            "apiGroups": ["inference.networking.k8s.io"],
            "resources": ["inferencepools"],
            "verbs": ["get", "list", "watch"],
        },
        {
            "apiGroups": ["llm-d.ai"],
            "resources": ["inferencemodelrewrites", "inferenceobjectives"],
            "verbs": ["get", "list", "watch"],
        },
    ]
    binding = r.get("RoleBinding", FULLNAME)
    assert binding["roleRef"]["name"] == FULLNAME
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": FULLNAME, "namespace": NAMESPACE}
    ]
    pod = r.get("Deployment", FULLNAME)["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == FULLNAME


def test_epp_pod_probes_security_and_ports(rendered: dict[str, Rendered]) -> None:
    r = rendered["defaults"]
    pod = r.get("Deployment", FULLNAME)["spec"]["template"]["spec"]
    container = r.epp_container()
    assert container["livenessProbe"]["grpc"] == {"port": 9003, "service": "liveness"}
    assert container["readinessProbe"]["grpc"] == {"port": 9003, "service": "readiness"}
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
        "grpc": 9002,
        "grpc-health": 9003,
        "metrics": 9090,
    }
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001  # the Dockerfile's USER
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts == {"config": "/config", "tmp": "/tmp"}
    # Longer than the drain, so SIGTERM → not ready → in-flight streams finish → exit.
    assert (
        pod["terminationGracePeriodSeconds"] > build_parser().parse_args(epp_args(r)).drain_timeout
    )


def test_replicas_run_active_active(rendered: dict[str, Rendered]) -> None:
    """No leader election: every replica subscribes per endpoint to every pod."""
    r = rendered["replicas-3"]
    deployment = r.get("Deployment", FULLNAME)
    assert deployment["spec"]["replicas"] == 3
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    params = precise_parameters(r.epp_config_text())
    assert params is not None and params["kvEvents"]["mode"] == "per-endpoint"
    assert not any("leader" in arg for arg in epp_args(r))
    pdb = r.get("PodDisruptionBudget", FULLNAME)
    assert pdb["spec"]["selector"] == deployment["spec"]["selector"]


def test_config_change_rolls_the_pods(helm: Helm) -> None:
    def checksum(values: dict[str, Any]) -> str:
        deployment = helm.template(values).get("Deployment", FULLNAME)
        value: str = deployment["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
        return value

    assert checksum({}) != checksum({"scheduling": {"weights": {"prefill-cost-scorer": 7}}})


# ---------------------------------------------------------------------------------------------
# The EPP accepts what the chart renders


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_rendered_config_is_accepted_by_the_epp_loader(
    rendered: dict[str, Rendered], variant: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`epp check-config` (load_config + build_scheduler) on the ConfigMap's file: catches a
    chart default that names a plugin type or parameter the EPP no longer has."""
    path = tmp_path / "epp-config.yaml"
    path.write_text(rendered[variant].epp_config_text())
    assert check_config(str(path)) == 0
    assert "OK" in capsys.readouterr().out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_rendered_args_are_accepted_by_epp_serve(
    rendered: dict[str, Rendered], variant: str
) -> None:
    r = rendered[variant]
    values = effective(VARIANTS[variant])
    args = build_parser().parse_args(epp_args(r))  # argparse exits on an unknown flag
    assert args.command == "serve"
    assert args.config_file == "/config/epp-config.yaml"
    assert (args.grpc_port, args.grpc_health_port, args.metrics_port) == (9002, 9003, 9090)
    assert args.max_body_bytes == values["maxBodyBytes"]
    mounts = {m["name"]: m["mountPath"] for m in r.epp_container()["volumeMounts"]}
    assert Path(args.config_file).parent == Path(mounts["config"])
    tls = values["tls"]
    assert args.secure_serving is tls["enabled"]
    if tls["enabled"] and tls["secretName"]:
        assert args.enable_cert_reload is True
        assert Path(args.cert_path) == Path(mounts["tls"])
    else:
        assert args.cert_path is None and "tls" not in mounts
    admission = values["admission"]
    assert args.max_in_flight_per_endpoint == admission["maxInFlightPerEndpoint"]
    if admission["maxInFlightPerEndpoint"]:
        assert args.admission_mode == admission["mode"]
        if admission["mode"] == "queue":
            assert args.max_queued_requests == admission["maxQueuedRequests"]
            assert args.max_queue_wait == admission["maxQueueWaitSeconds"]
    if precise_parameters(r.epp_config_text()) is not None:
        assert args.kv_events_port == values["vllm"]["kvEventsPort"]
        assert args.kv_events_replay_port == values["vllm"]["kvEventsReplayPort"]
    else:
        assert args.kv_events_port is None  # no precise scorer: no subscriptions


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "config-text"])
def test_precise_scorer_gets_the_model_server_settings(
    rendered: dict[str, Rendered], variant: str
) -> None:
    """One source of truth: blockSize, hashAlgo, hashSeed, kvEvents and the tokenizer come from
    the values that NOTES.txt turns into the pods' flags."""
    values = effective(VARIANTS[variant])
    params = precise_parameters(rendered[variant].epp_config_text())
    assert params is not None
    vllm = values["vllm"]
    assert params.get("blockSize") == vllm["blockSize"]
    assert params["hashAlgo"] == vllm["hashAlgo"]
    seed = vllm["pythonHashSeed"]
    assert params.get("hashSeed") == (None if seed is None else str(seed))
    assert params["kvEvents"]["mode"] == values["kvEvents"]["mode"]
    if values["kvEvents"]["mode"] == "central":
        assert params["kvEvents"]["bindAddress"] == f"tcp://*:{vllm['kvEventsPort']}"


def test_tokenizer_volume_is_mounted_where_the_scorer_looks(rendered: dict[str, Rendered]) -> None:
    r = rendered["tokenizer-volume"]
    params = precise_parameters(r.epp_config_text())
    assert params is not None
    assert params["tokenizer"] == "/tokenizers/llama-3.1-8b"
    assert params["tokenizers"] == {"mistral-7b": "/tokenizers/mistral-7b", "qwen": "/opt/qwen"}
    pod = r.get("Deployment", FULLNAME)["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "tokenizers")
    assert volume["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    mount = next(m for m in r.epp_container()["volumeMounts"] if m["name"] == "tokenizers")
    assert mount == {"name": "tokenizers", "mountPath": "/tokenizers", "readOnly": True}
    assert [c["name"] for c in pod["initContainers"]] == ["fetch"]
    # Without a path, the mount itself is the tokenizer directory.
    params = precise_parameters(rendered["everything"].epp_config_text())
    assert params is not None and params["tokenizer"] == "/tokenizers"


def test_weights_are_plain_values(rendered: dict[str, Rendered], helm: Helm) -> None:
    config = load_config(text=rendered["custom-weights"].epp_config_text())
    (profile,) = config.schedulingProfiles
    weights = {ref.pluginRef: ref.weight for ref in profile.plugins}
    assert weights == {
        "decode-filter": 1.0,
        "prefix": 5.0,
        "queue-scorer": 1.5,
        "kv-cache-utilization-scorer": 0.0,
        "active-request-scorer": 1.0,
        "weighted-random-picker": 1.0,
    }
    assert "single-profile-handler" in [p.name for p in config.plugins]
    # The defaults, and --set (which passes decimals as strings).
    default = load_config(text=rendered["defaults"].epp_config_text())
    assert {r.pluginRef: r.weight for r in default.schedulingProfiles[0].plugins} == {
        "prefill-cost-scorer": 1.0,
        "max-score-picker": 1.0,
    }
    text = helm.template(sets=["scheduling.weights.prefill-cost-scorer=0.25"]).epp_config_text()
    weights = {r.pluginRef: r.weight for r in load_config(text=text).schedulingProfiles[0].plugins}
    assert weights["prefill-cost-scorer"] == 0.25


def test_default_scheduling_is_the_epps_own_default(rendered: dict[str, Rendered]) -> None:
    # The chart's default values must deploy the policy `epp serve` runs without a config file
    # (the one docs/routing-results.md measures), apart from the model-server settings the
    # chart injects into the precise scorer.
    injected = {"blockSize", "hashAlgo", "hashSeed", "tokenizer", "tokenizers", "kvEvents"}

    def policy(text: str) -> tuple[object, ...]:
        config = load_config(text=text)
        plugins = sorted(
            (p.name, p.type, sorted((k, v) for k, v in p.parameters.items() if k not in injected))
            for p in config.plugins
        )
        profiles = [
            (sorted((r.pluginRef, r.weight) for r in profile.plugins))
            for profile in config.schedulingProfiles
        ]
        return plugins, profiles

    assert policy(rendered["defaults"].epp_config_text()) == policy(DEFAULT_CONFIG_YAML)


def test_config_text_is_used_verbatim(rendered: dict[str, Rendered]) -> None:
    r = rendered["config-text"]
    assert (
        r.epp_config_text().strip() == VARIANTS["config-text"]["scheduling"]["configText"].strip()
    )


def test_values_schema_knows_every_hash_algorithm() -> None:
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    assert tuple(schema["properties"]["vllm"]["properties"]["hashAlgo"]["enum"]) == HASH_ALGOS


@pytest.mark.parametrize(
    ("values", "sets", "message"),
    [
        ({"kvEvents": {"mode": "central"}, "replicas": 2}, [], "central works with replicas: 1"),
        ({"scheduling": {"weights": {"prefix-cache": 2}}}, [], 'no plugin named "prefix-cache"'),
        (
            {
                "scheduling": {
                    "plugins": [
                        {"type": "precise-prefix-cache-scorer", "parameters": {"blockSize": 16}}
                    ]
                }
            },
            [],
            "parameters.blockSize is set from the chart's values",
        ),
        ({"vllm": {"hashAlgo": "xxhash", "pythonHashSeed": None}}, [], "needs vllm.pythonHashSeed"),
        ({"vllm": {"hashAlgo": "md5"}}, [], "/vllm/hashAlgo"),
        (
            {},
            ["scheduling.weights.prefill-cost-scorer=-1"],
            "/scheduling/weights/prefill-cost-scorer",
        ),
        ({"scheduling": {"weight": {"queue-scorer": 1}}}, [], "weight"),
        ({"scheduling": {"plugins": []}}, [], "scheduling.plugins is empty"),
        ({"envoy": {"enabled": True, "requestBodyMode": "STREAMED"}}, [], "requestBodyMode"),
        ({"admission": {"mode": "drop"}}, [], "/admission/mode"),
        ({"admission": {"maxInFlightPerEndpoint": 0}}, [], "/admission/maxInFlightPerEndpoint"),
        (
            {"modelServers": {"targetPorts": [8000, 8001]}},
            [],
            "vllm.kvEventsPort 5557 and vllm.kvEventsReplayPort 5558 clash for 2 data-parallel",
        ),
    ],
)
def test_inconsistent_values_are_refused(
    helm: Helm, values: dict[str, Any], sets: list[str], message: str
) -> None:
    assert message in helm.template_error(values, sets=sets)


# ---------------------------------------------------------------------------------------------
# Envoy


@pytest.mark.parametrize("variant", ENVOY_VARIANTS)
def test_envoy_config_passes_envoy_validate(
    rendered: dict[str, Rendered], variant: str, tmp_path: Path
) -> None:
    result = validate_config(rendered[variant].envoy_config_text(), tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("variant", ENVOY_VARIANTS)
def test_envoy_config_is_the_one_epp_envoy_bootstrap_renders(
    rendered: dict[str, Rendered], variant: str
) -> None:
    """The chart's template and `render_envoy_config` (which the demo and the end-to-end tests
    run for real) must not drift apart."""
    values = effective(VARIANTS[variant])
    envoy = values["envoy"]
    chart = yaml.safe_load(rendered[variant].envoy_config_text())
    reference = yaml.safe_load(
        render_envoy_config(
            listen_port=envoy["listenPort"],
            extproc_port=9002,
            admin_port=envoy["adminPort"],
            request_body_mode=envoy["requestBodyMode"],
            extproc_host=f"{FULLNAME}-ext-proc.{NAMESPACE}.svc.cluster.local",
            listen_host="0.0.0.0",
            admin_host="127.0.0.1",
            failure_mode_allow=envoy["failureModeAllow"],
            message_timeout_s=envoy["messageTimeoutSeconds"],
            route_timeout_s=envoy["routeTimeoutSeconds"],
            connect_timeout_s=envoy["connectTimeoutSeconds"],
            upstream_idle_timeout_s=envoy["upstreamIdleTimeoutSeconds"],
            max_request_body_bytes=values["maxBodyBytes"],
            extproc_tls=values["tls"]["enabled"],
            extproc_health_check_interval_s=envoy["extProcHealthCheckIntervalSeconds"],
        )
    )
    assert chart == reference


def test_envoy_reaches_every_epp_replica_through_a_headless_service(
    rendered: dict[str, Rendered],
) -> None:
    r = rendered["everything"]
    headless = r.get("Service", f"{FULLNAME}-ext-proc")
    assert headless["spec"]["clusterIP"] == "None"
    epp = r.get("Deployment", FULLNAME)
    assert headless["spec"]["selector"] == epp["spec"]["selector"]["matchLabels"]
    cluster = yaml.safe_load(r.envoy_config_text())["static_resources"]["clusters"][0]
    assert cluster["type"] == "STRICT_DNS"
    envoy = r.get("Deployment", f"{FULLNAME}-envoy")
    (container,) = envoy["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["/usr/local/bin/envoy"]
    assert container["args"][:2] == ["--config-path", "/etc/envoy/envoy.yaml"]
    volume = envoy["spec"]["template"]["spec"]["volumes"][0]
    assert volume["configMap"]["name"] == f"{FULLNAME}-envoy"
    # The ServiceMonitor must not also scrape the headless Service (same pods twice).
    monitor = r.get("ServiceMonitor", FULLNAME)
    selector = monitor["spec"]["selector"]["matchLabels"]
    matching = [
        s["metadata"]["name"]
        for s in r.all("Service")
        if selector.items() <= s["metadata"]["labels"].items()
    ]
    assert matching == [FULLNAME]


# ---------------------------------------------------------------------------------------------
# NOTES.txt: the vLLM side of the contract


@pytest.mark.parametrize(
    "variant", ["defaults", "inference-pool", "central-events", "vllm-defaults", "everything"]
)
def test_notes_print_vllm_flags_that_match_the_epp(
    helm: Helm, rendered: dict[str, Rendered], variant: str
) -> None:
    notes = helm.notes(VARIANTS[variant])
    args, env = vllm_flags(notes)
    r = rendered[variant]
    params = precise_parameters(r.epp_config_text())
    assert params is not None
    epp = build_parser().parse_args(epp_args(r))
    values = effective(VARIANTS[variant])

    def flag(name: str) -> str | None:
        for i, arg in enumerate(args):
            if arg == name:
                return str(args[i + 1])
            if arg.startswith(name + "="):
                return str(arg.split("=", 1)[1])
        return None

    assert "--enable-prefix-caching" in args
    block_size = flag("--block-size")
    assert (int(block_size) if block_size else None) == params.get("blockSize")
    assert flag("--prefix-caching-hash-algo") == params["hashAlgo"]
    assert env.get("PYTHONHASHSEED") == params.get("hashSeed")
    assert "POD_IP" in env

    events_json = flag("--kv-events-config")
    assert events_json is not None
    events = json.loads(events_json)
    # docs/vllm-interop.md §5: the KVEventsConfig fields.
    assert set(events) <= {
        "enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "buffer_steps",
        "hwm", "max_queue_size", "topic",
    }  # fmt: skip
    assert events["enable_kv_cache_events"] is True
    assert events["publisher"] == "zmq"
    if params["kvEvents"]["mode"] == "central":
        # vLLM connects (no '*') to the EPP's Service, where the EPP binds.
        assert events["endpoint"] == (
            f"tcp://{FULLNAME}.{NAMESPACE}.svc:{values['vllm']['kvEventsPort']}"
        )
        service_ports = {p["name"]: p["port"] for p in r.get("Service", FULLNAME)["spec"]["ports"]}
        assert service_ports["kv-events"] == values["vllm"]["kvEventsPort"]
    else:
        # vLLM binds (the endpoint has '*'); the EPP connects to <pod IP>:--kv-events-port.
        assert events["endpoint"] == f"tcp://*:{epp.kv_events_port}"
    if epp.kv_events_replay_port is None:
        assert "replay_endpoint" not in events
    else:
        assert events["replay_endpoint"] == f"tcp://*:{epp.kv_events_replay_port}"
    first_port = values["modelServers"]["targetPorts"][0]
    model = values["modelServers"]["modelName"] or "SERVED_MODEL_NAME"
    assert events["topic"] == f"kv@$(POD_IP):{first_port}@{model}"
    # A shell can paste the JSON as one argument.
    assert shlex.split(f"x '{events_json}'")[1] == events_json


def test_notes_warn_when_no_tokenizer_is_configured(helm: Helm) -> None:
    assert "WARNING: no tokenizer configured" in helm.notes({})
    assert "WARNING" not in helm.notes(VARIANTS["tokenizer-volume"])


# ---------------------------------------------------------------------------------------------
# Grafana dashboard


def test_dashboard_is_shipped_as_a_labelled_config_map(rendered: dict[str, Rendered]) -> None:
    r = rendered["monitoring"]
    cm = r.get("ConfigMap", f"{FULLNAME}-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["kv-epp.json"])
    assert dashboard == json.loads((CHART_DIR / "dashboards" / "kv-epp.json").read_text())
    assert dashboard["uid"] == "kv-epp"
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]


def test_a_shared_kv_store_and_the_kv_cache_api_are_wired(
    rendered: dict[str, Rendered], helm: Helm
) -> None:
    r = rendered["kv-store"]
    params = precise_parameters(r.epp_config_text())
    assert params is not None
    assert params["kvBlockIndexConfig"] == {
        "redisConfig": {
            "address": f"redis://{RELEASE}-kv-epp-valkey.{NAMESPACE}.svc:6379",
            "namespace": f"{RELEASE}-kv-epp",
        }
    }
    valkey = r.get("Deployment", f"{RELEASE}-kv-epp-valkey")
    service = r.get("Service", f"{RELEASE}-kv-epp-valkey")
    pod_labels = valkey["spec"]["template"]["metadata"]["labels"]
    assert all(pod_labels[k] == v for k, v in service["spec"]["selector"].items())
    assert "--kv-cache-grpc-port=9004" in epp_args(r)
    ports = {p["name"]: p["port"] for p in r.get("Service", f"{RELEASE}-kv-epp")["spec"]["ports"]}
    assert ports["kv-cache-api"] == 9004
    # Off by default: no store, no API port, no Valkey.
    plain = rendered["vllm-defaults"]
    assert "kvBlockIndexConfig" not in (precise_parameters(plain.epp_config_text()) or {})
    assert not any("kv-cache-grpc-port" in a for a in epp_args(plain))
    assert not [d for d in plain.all("Deployment") if d["metadata"]["name"].endswith("-valkey")]
    # Your own server instead; both at once is refused.
    own = helm.template({"kvStore": {"address": "rediss://cache.example:6380", "namespace": "p"}})
    own_params = precise_parameters(own.epp_config_text()) or {}
    assert own_params["kvBlockIndexConfig"]["redisConfig"] == {
        "address": "rediss://cache.example:6380",
        "namespace": "p",
    }
    error = helm.template_error(
        {"kvStore": {"address": "redis://x:6379", "valkey": {"enabled": True}}}
    )
    assert "not both" in error
