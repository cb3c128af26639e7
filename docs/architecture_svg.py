"""Draws docs/architecture.svg, the picture in docs/architecture.md, from the tables below.

    python docs/architecture_svg.py          # rewrites docs/architecture.svg (standard library only)

Edit the boxes and arrows here, not the SVG, and keep docs/architecture.md's text diagram in step.
A line too wide for its box is reported on stderr.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

OUT = Path(__file__).with_name("architecture.svg")
WIDTH, HEIGHT = 1400, 1150
SANS = "DejaVu Sans, Helvetica, Arial, sans-serif"
MONO = "DejaVu Sans Mono, Menlo, Consolas, monospace"
MONO_CHAR = 6.7  # px per character at 11 px, a little above DejaVu Sans Mono's 6.62

# Owner → (fill, stroke): the folder that owns a step.
COLOURS = {
    "outside": ("#eeeeee", "#888888"),
    "epp": ("#dbe8f6", "#4a78a8"),
    "scorers": ("#f8ebd5", "#a4772f"),
    "indexer": ("#dcf0dc", "#4b8b4b"),
    "kvcache": ("#e6def3", "#6e56a0"),
}

LEFT, MID, RIGHT = (30, 430), (560, 310), (970, 400)  # column x and width
TOP, STEP, H = 100, 88, 70  # first row's y, row pitch, box height


def row(i: int) -> int:
    return TOP + i * STEP


@dataclass(frozen=True)
class Box:
    key: str
    column: tuple[int, int]
    row: int
    owner: str
    title: str
    lines: tuple[str, ...]
    dashed: bool = False

    @property
    def x(self) -> int:
        return self.column[0]

    @property
    def y(self) -> int:
        return row(self.row)

    @property
    def w(self) -> int:
        return self.column[1]

    def side(self, where: str) -> tuple[float, float]:
        """A point on the box: l, r, t, b (middle of a side) or l/r/t/b plus ±offset."""
        name, _, off = where.partition(":")
        d = float(off) if off else 0.0
        cx, cy = self.x + self.w / 2, self.y + H / 2
        return {
            "l": (self.x, cy + d),
            "r": (self.x + self.w, cy + d),
            "t": (cx + d, self.y),
            "b": (cx + d, self.y + H),
        }[name]


# fmt: off
BOXES = [
    # The request path, top to bottom.
    Box("envoy", LEFT, 0, "outside", "Envoy (the gateway)",
        ("ext_proc filter: request headers + body to the EPP",
         "then ORIGINAL_DST cluster → the chosen vLLM pod")),
    Box("extproc", LEFT, 1, "epp", "1  ext_proc server (gRPC, one stream per request)",
        ("epp/extproc.py",
         "ExtProcServicer.Process → ExtProcStream.handle")),
    Box("parse", LEFT, 2, "epp", "2  parse the body",
        ("epp/requests.py",
         "parse_request → LLMRequest (scorers/base.py)")),
    Box("director", LEFT, 3, "epp", "3  candidates, admission, in-flight accounting",
        ("epp/director.py, epp/admission.py",
         "Director.route → AdmissionController.admit")),
    Box("scheduler", LEFT, 4, "epp", "4  schedule",
        ("epp/scheduler.py",
         "Scheduler.schedule: prepare → profiles → pre_request")),
    Box("tokenize", LEFT, 5, "indexer", "5  tokenize as vLLM (chat template, specials)",
        ("indexer/tokenization.py",
         "PromptTokenizer.encode_chat / .encode_completion")),
    Box("hash", LEFT, 6, "indexer", "6  block keys: vLLM-exact hashes of full blocks",
        ("indexer/hashing.py",
         "PrefixHasher.digests → event_keys")),
    Box("lookup", LEFT, 7, "indexer", "7  index lookup (longest held prefix per pod)",
        ("indexer/index.py",
         "KVBlockIndex.prefix_match → request.data")),
    Box("scorers", LEFT, 8, "scorers", "8  filters, then scorers (clamped to [0, 1], × weight)",
        ("SchedulerProfile.run (epp/scheduler.py)",
         "PrefillCostScorer.score (scorers/prefill_cost.py)")),
    Box("picker", LEFT, 9, "scorers", "9  picker (profile handler around it)",
        ("scorers/pickers.py, scorers/profiles.py",
         "MaxScorePicker.pick, SingleProfileHandler")),
    Box("answer", LEFT, 10, "epp", "10  headers back to Envoy",
        ("epp/extproc.py  ExtProcStream._headers_response",
         "x-gateway-destination-endpoint + envoy.lb metadata")),
    # Shared state and the response path.
    Box("datastore", MID, 3, "epp", "Datastore",
        ("epp/datastore.py",
         "Endpoint: spec, metrics, in-flight load")),
    Box("listeners", MID, 5, "epp", "endpoint listeners",
        ("Datastore.add_listener: MetricsScraper,",
         "Scheduler.endpoint_added → plugins")),
    Box("index", MID, 7, "indexer", "KV-block index (state)",
        ("indexer/index.py  KVBlockIndex",
         "block key → endpoints × tier, bounded")),
    Box("response", MID, 9, "epp", "response path (same ext_proc stream)",
        ("Director.response_chunk / _complete",
         "→ in-flight load, ResponseComplete plugins"),
        dashed=True),
    # Discovery and scraping, then the KV-event path.
    Box("k8s", RIGHT, 0, "outside", "Kubernetes API, or flags",
        ("InferencePool + its pods (list + watch)",
         "or --endpoints / --endpoints-file")),
    Box("discovery", RIGHT, 1, "epp", "discovery",
        ("epp/discovery/kubernetes.py, static.py",
         "KubernetesDiscovery | StaticDiscovery")),
    Box("metrics", RIGHT, 2, "outside", "vLLM pods: GET /metrics",
        ("vllm:num_requests_*, kv_cache_usage_perc,",
         "cache_config_info, lora_requests_info")),
    Box("scraper", RIGHT, 3, "epp", "metrics scraping (every 50-150 ms)",
        ("epp/scraping.py",
         "MetricsScraper → parse_vllm_metrics")),
    Box("zmq", RIGHT, 4, "outside", "vLLM pods: KV events over ZMQ",
        ("PUB [topic, seq, msgpack KVEventBatch]",
         "replay ROUTER for gaps")),
    Box("subscriber", RIGHT, 5, "indexer", "subscriber (in order, gaps replayed)",
        ("indexer/subscriber.py",
         "SubscriberPool | CentralSubscriber")),
    Box("decode", RIGHT, 6, "indexer", "decode (every vLLM wire form)",
        ("indexer/events.py",
         "decode_batch → KVEventBatch")),
    Box("apply", RIGHT, 7, "kvcache", "view → index (hashes self-checked)",
        ("kvcache/view.py → indexer/index.py",
         "KVCacheView.apply → KVBlockIndex.apply")),
    # Not in the EPP's process: what stands in for the grey boxes, and what deploys it.
    Box("around", RIGHT, 9, "outside", "around the EPP (other processes)",
        ("simulator/ simulated vLLM pods: HTTP, /metrics, ZMQ",
         "launcher/ starts pods, epp serve, Envoy; deploy/ Helm"),
        dashed=True),
]
# fmt: on

# (from "box:side", to "box:side", label, dashed, waypoints)
ARROWS: list[tuple[str, str, str, bool, tuple[tuple[float, float], ...]]] = [
    ("envoy:b", "extproc:t", "", False, ()),
    ("extproc:b", "parse:t", "", False, ()),
    ("parse:b", "director:t", "", False, ()),
    ("director:b", "scheduler:t", "", False, ()),
    ("scheduler:b", "tokenize:t", "", False, ()),
    ("tokenize:b", "hash:t", "token ids", False, ()),
    ("hash:b", "lookup:t", "block keys", False, ()),
    ("lookup:b", "scorers:t", "", False, ()),
    ("scorers:b", "picker:t", "", False, ()),
    ("picker:b", "answer:t", "", False, ()),
    ("answer:l", "envoy:l", "", False, ((14, row(10) + H / 2), (14, row(0) + H / 2))),
    ("datastore:l", "director:r", "candidates", False, ()),
    ("index:l", "lookup:r", "held blocks", False, ()),
    ("datastore:b", "listeners:t", "added / removed", True, ()),
    ("listeners:r", "subscriber:l", "subscribe", True, ()),
    ("k8s:b", "discovery:t", "", False, ()),
    ("discovery:l", "datastore:t", "apply_specs", False, ((MID[0] + MID[1] / 2, row(1) + H / 2),)),
    ("metrics:b", "scraper:t", "", False, ()),
    ("scraper:l", "datastore:r", "update_metrics", False, ()),
    ("zmq:b", "subscriber:t", "", False, ()),
    ("subscriber:b", "decode:t", "payload", False, ()),
    ("decode:b", "apply:t", "", False, ()),
    ("apply:l", "index:r", "stored / removed", False, ()),
]

# Steps 5-7 are one plugin's data-producer step: a frame around them, its caption beside it.
GROUP = (LEFT[0] - 8, row(5) - 7, LEFT[1] + 16, 2 * STEP + H + 14)
GROUP_CAPTION = (
    "steps 5-7: a plugin's prepare() through",
    "its KV-cache view (kvcache/view.py):",
    "PrecisePrefixCacheScorer.prepare, a data",
    "producer, in the CPU executor",
)

HEADERS = [
    (LEFT[0], "REQUEST PATH (per request)"),
    (MID[0], "SHARED STATE"),
    (RIGHT[0], "DISCOVERY, SCRAPING, KV EVENTS (background)"),
]

FOOTER = [
    "Built and started by EndpointPicker (epp/server.py) for `epp serve` (epp/cli.py); the plugins "
    "come from the EndpointPickerConfig",
    "(epp/config.py: load_config, build_scheduler → scorers.base.create_plugin). Imports go one "
    "way: epp/ → scorers/ → indexer/.",
]


def text(x: float, y: float, s: str, *, size: float = 11, mono: bool = False, **attrs: str) -> str:
    extra = "".join(f' {k.replace("_", "-")}="{v}"' for k, v in attrs.items())
    family = MONO if mono else SANS
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" font-family="{family}" font-size="{size}"{extra}>'
        f"{escape(s)}</text>"
    )


def draw_box(b: Box, out: list[str]) -> None:
    fill, stroke = COLOURS[b.owner]
    dash = ' stroke-dasharray="5 3"' if b.dashed else ""
    out.append(
        f'<rect x="{b.x}" y="{b.y}" width="{b.w}" height="{H}" rx="6" fill="{fill}" '
        f'stroke="{stroke}" stroke-width="1.4"{dash}/>'
    )
    out.append(text(b.x + 10, b.y + 19, b.title, size=12.5, font_weight="bold"))
    for i, line in enumerate(b.lines):
        out.append(text(b.x + 10, b.y + 38 + 15 * i, line, mono=True))
        if len(line) * MONO_CHAR > b.w - 16:
            print(f"too wide for box {b.key!r}: {line!r}", file=sys.stderr)


def draw_arrow(
    boxes: dict[str, Box],
    start: str,
    end: str,
    label: str,
    dashed: bool,
    via: tuple[tuple[float, float], ...],
    out: list[str],
) -> None:
    a_key, a_side = start.split(":", 1)
    b_key, b_side = end.split(":", 1)
    points = [boxes[a_key].side(a_side), *via, boxes[b_key].side(b_side)]
    path = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
    dash = ' stroke-dasharray="6 4"' if dashed else ""
    out.append(
        f'<polyline points="{path}" fill="none" stroke="#444" stroke-width="1.5"{dash} '
        f'marker-end="url(#head)"/>'
    )
    if label:
        (x1, y1), (x2, y2) = points[-2], points[-1]
        if abs(x2 - x1) >= abs(y2 - y1):  # horizontal: label above the middle
            out.append(
                text(
                    (x1 + x2) / 2,
                    (y1 + y2) / 2 - 5,
                    label,
                    size=10.5,
                    text_anchor="middle",
                    fill="#333",
                    font_style="italic",
                )
            )
        else:  # vertical: label to the right of the middle
            out.append(
                text(x1 + 6, (y1 + y2) / 2 + 4, label, size=10.5, fill="#333", font_style="italic")
            )


def legend(out: list[str], y: float) -> None:
    x: float = LEFT[0]
    for owner, caption in [
        ("outside", "outside the EPP"),
        ("epp", "epp/"),
        ("scorers", "scorers/ (plugins)"),
        ("kvcache", "kvcache/ (the view)"),
        ("indexer", "indexer/ (vLLM compatibility)"),
    ]:
        fill, stroke = COLOURS[owner]
        out.append(
            f'<rect x="{x}" y="{y - 11}" width="22" height="14" rx="3" fill="{fill}" '
            f'stroke="{stroke}"/>'
        )
        out.append(text(x + 30, y, caption))
        x += 60 + len(caption) * 6.5
    out.append(
        f'<line x1="{x}" y1="{y - 4}" x2="{x + 34}" y2="{y - 4}" stroke="#444" '
        f'stroke-width="1.5" stroke-dasharray="6 4" marker-end="url(#head)"/>'
    )
    out.append(text(x + 44, y, "endpoint set changes"))


def render() -> str:
    boxes = {b.key: b for b in BOXES}
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}">',
        '<defs><marker id="head" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
        'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" '
        'fill="#444"/></marker></defs>',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="#ffffff"/>',
        text(
            LEFT[0],
            34,
            "kv-epp: where a request goes, and what feeds the decision",
            size=18,
            font_weight="bold",
        ),
    ]
    for x, caption in HEADERS:
        out.append(text(x, 80, caption, size=11.5, font_weight="bold", fill="#555"))
    gx, gy, gw, gh = GROUP
    out.append(
        f'<rect x="{gx}" y="{gy}" width="{gw}" height="{gh}" rx="8" fill="none" '
        f'stroke="#a4772f" stroke-width="1.2" stroke-dasharray="4 3"/>'
    )
    for i, line in enumerate(GROUP_CAPTION):
        out.append(
            text(MID[0], row(6) + 16 + 15 * i, line, size=11, fill="#7a5a20", font_style="italic")
        )
    for b in BOXES:
        draw_box(b, out)
    for start, end, label, dashed, via in ARROWS:
        draw_arrow(boxes, start, end, label, dashed, via, out)
    bottom = row(10) + H
    legend(out, bottom + 34)
    for i, line in enumerate(FOOTER):
        out.append(text(LEFT[0], bottom + 62 + 16 * i, line, size=11, fill="#333"))
    out.append("</svg>")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
