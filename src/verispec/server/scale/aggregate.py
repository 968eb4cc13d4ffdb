"""One `/metrics` and one `/v1/stats` for every replica: counters summed, histograms merged bucket by bucket.

Each replica renders its own registry (server/metrics.py); the ingress parses the texts and writes each series
twice: summed over replicas (no `replica` label: what a dashboard of the whole service plots) and per replica
(`replica="<id>"`). Histograms merge exactly by summing `_bucket`, `_count` and `_sum`: every replica uses the
same buckets. A replica that died keeps its last scraped counters (`retired`), so the totals never go back when
Serve replaces it; its gauges (queue, batch) are dropped, as nothing runs there any more. `_created` samples
(timestamps) are left out: they do not add up.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

REPLICA_LABEL = "replica"
Series = tuple[str, tuple[tuple[str, str], ...]]  # (sample name, sorted labels)


@dataclass
class _Family:
    kind: str
    doc: str
    total: dict[Series, float] = field(default_factory=lambda: defaultdict(float))
    by_replica: dict[Series, float] = field(default_factory=dict)


def merge(texts: dict[str, str], retired: frozenset[str] = frozenset()) -> dict[str, _Family]:
    """{replica id: its /metrics text} -> families with summed and per-replica series (in first-seen order)."""
    families: dict[str, _Family] = {}
    for replica, text in texts.items():
        for parsed in text_string_to_metric_families(text):
            if replica in retired and parsed.type == "gauge":
                continue
            family = families.setdefault(parsed.name, _Family(parsed.type, parsed.documentation))
            for sample in parsed.samples:
                if sample.name.endswith("_created"):
                    continue
                labels = tuple(sorted(sample.labels.items()))
                family.total[(sample.name, labels)] += sample.value
                tagged = tuple(sorted({**sample.labels, REPLICA_LABEL: replica}.items()))
                family.by_replica[(sample.name, tagged)] = sample.value
    return families


def render(families: dict[str, _Family]) -> str:
    """Prometheus text exposition of merged families."""
    lines = []
    for name, family in families.items():
        lines.append(f"# HELP {name} {_escape(family.doc, help=True)}")
        lines.append(f"# TYPE {name} {family.kind}")
        for series in (family.total, family.by_replica):
            lines += [f"{sample}{_labels(labels)} {_number(value)}" for (sample, labels), value in series.items()]
    return "\n".join(lines) + "\n"


def totals(families: dict[str, _Family]) -> dict[str, float]:
    """{'name{k="v"}': summed value} of every series: what `/v1/stats` reports as totals."""
    return {f"{sample}{_labels(labels)}": value for family in families.values()
            for (sample, labels), value in family.total.items()}


def per_replica(families: dict[str, _Family]) -> dict[str, dict[str, float]]:
    """{replica: {'name{k="v"}': value}}."""
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for family in families.values():
        for (sample, labels), value in family.by_replica.items():
            replica = dict(labels)[REPLICA_LABEL]
            rest = tuple(item for item in labels if item[0] != REPLICA_LABEL)
            out[replica][f"{sample}{_labels(rest)}"] = value
    return dict(out)


def summary(total: dict[str, float]) -> dict[str, float | None]:
    """The headline ratios of the summed counters (DEVELOPERS.md's vocabulary)."""
    draft, accepted = total.get("verispec_draft_tokens_total", 0.0), total.get("verispec_accepted_tokens_total", 0.0)
    rounds, generated = total.get("verispec_rounds_total", 0.0), total.get("verispec_generated_tokens_total", 0.0)
    queries = total.get("verispec_prefix_cache_queries_total", 0.0)
    hits = total.get("verispec_prefix_cache_hits_total", 0.0)
    return {"acceptance_rate": accepted / draft if draft else None,
            "mean_accepted_length": generated / rounds if rounds else None,
            "prefix_cache_hit_rate": hits / queries if queries else None,  # prompt tokens found / looked up
            "generated_tokens": generated, "prompt_tokens": total.get("verispec_prompt_tokens_total", 0.0)}


def _labels(labels: tuple[tuple[str, str], ...]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{key}="{_escape(value)}"' for key, value in labels) + "}"


def _escape(text: str, help: bool = False) -> str:
    text = text.replace("\\", "\\\\").replace("\n", "\\n")
    return text if help else text.replace('"', '\\"')


def _number(value: float) -> str:
    if value == int(value) and abs(value) < 2**53:
        return f"{int(value)}.0"
    return repr(value)
