"""vllm-monitor: scrape the scheduler's Prometheus endpoint every --interval seconds and print live values.

    vllm-monitor --metric vllm:num_requests_running --metric vllm:generation_tokens --interval 1

A gauge prints its value; a counter its total and its rate since the previous scrape; a histogram its count,
mean and the rate of new observations. Names are the series names (`vllm:generation_tokens` or
`vllm:generation_tokens_total` both work), or one of the short names of ALIASES (--help lists them):

    vllm-monitor --metric memory_usage --metric cache_hit_rate --metric fragmentation
"""

from __future__ import annotations

import argparse
import difflib
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from settings.commands import command_parser
from settings.config_file import parse_args

# short name -> the series it prints (the design article's names: memory_usage, cache_hit_rate, fragmentation)
ALIASES = {
    "cache_hit_rate": ["minivllm:cache_hit_rate"],  # per tier: prompt tokens found / looked up, since start
    "memory_usage": [  # KV bytes per tier and format, the share of blocks in use, and their fragmentation
        "minivllm:kv_cache_used_bytes",
        "minivllm:kv_cache_allocated_bytes",
        "vllm:kv_cache_usage_perc",
        "minivllm:kv_fragmentation",
    ],
    # 1 - tokens stored / slots of the blocks held: mostly each sequence's partly filled last block. Above 0.2 for
    # long, a smaller --block-size packs tighter.
    "fragmentation": ["minivllm:kv_fragmentation"],
    "spec_decode": [  # speculative decoding: proposals, accepted tokens, and accepted per position
        "vllm:spec_decode_num_drafts",
        "vllm:spec_decode_num_draft_tokens",
        "vllm:spec_decode_num_accepted_tokens",
        "vllm:spec_decode_num_accepted_tokens_per_pos",
    ],
}


@dataclass(frozen=True, slots=True)
class Reading:
    """One series of one metric at one scrape: labels and the numbers that describe it."""

    kind: str  # gauge, counter, histogram, summary, untyped
    labels: str  # '{model_name="x"}' or ''
    value: float  # gauge/counter value; histogram: the sum
    count: float = 0.0  # histogram: observations


def build_parser() -> argparse.ArgumentParser:
    p = command_parser("vllm-monitor", "Print live values of a minivllm server's metrics.")
    p.epilog = "short names for --metric:\n" + "\n".join(
        f"  {name:<15} {', '.join(series)}" for name, series in ALIASES.items()
    )
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    return p


def scrape(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return str(response.read().decode())


def readings(text: str, names: list[str]) -> dict[str, dict[str, Reading]]:
    """name -> labels -> Reading, for the asked names found in the exposition text."""
    wanted = {_base(n): n for n in names}
    out: dict[str, dict[str, Reading]] = {}
    for family in text_string_to_metric_families(text):
        name = wanted.get(_base(family.name))
        if name is None:
            continue
        series = out.setdefault(name, {})
        sums: dict[str, float] = {}
        counts: dict[str, float] = {}
        for sample in family.samples:
            labels = _labels({k: v for k, v in sample.labels.items() if k not in ("le", "quantile")})
            if family.type in ("histogram", "summary"):
                if sample.name.endswith("_sum"):
                    sums[labels] = sample.value
                elif sample.name.endswith("_count"):
                    counts[labels] = sample.value
            elif not sample.name.endswith("_created"):
                series[labels] = Reading(family.type, labels, sample.value)
        for labels, count in counts.items():
            series[labels] = Reading(family.type, labels, sums.get(labels, 0.0), count)
    return out


def describe(name: str, now: Reading, before: Reading | None, seconds: float) -> str:
    if now.kind in ("histogram", "summary"):
        mean = now.value / now.count if now.count else 0.0
        text = f"{name}{now.labels} count={now.count:g} mean={mean:.6g}"
        if before is not None and seconds > 0:
            text += f" (+{(now.count - before.count) / seconds:.3g}/s)"
        return text
    text = f"{name}{now.labels} {now.value:.6g}"
    if name.endswith("_bytes"):
        text += f" ({now.value / 2**30:.3f} GiB)"
    if now.kind == "counter" and before is not None and seconds > 0:
        text += f" (+{(now.value - before.value) / seconds:.3g}/s)"
    return text


def expand(names: list[str]) -> list[str]:
    """The series names asked for, aliases replaced by what they stand for (each series once)."""
    return list(dict.fromkeys(series for name in names for series in ALIASES.get(name, [name])))


def unknown(missing: list[str], text: str, url: str) -> str:
    """The error for names the endpoint does not have: the close ones, the short names and the series there."""
    there = sorted({family.name for family in text_string_to_metric_families(text)})
    lines = [f"error: no metric {', '.join(missing)} at {url}"]
    for name in missing:
        close = difflib.get_close_matches(_base(name), [*ALIASES, *there], n=3, cutoff=0.6)
        lines += [f"  {name}: did you mean {' or '.join(close)}?"] if close else []
    lines.append(f"  short names: {', '.join(ALIASES)}")
    lines.append(f"  series at {url}: {', '.join(there)}")
    return "\n".join(lines)


def _base(name: str) -> str:
    return name.removesuffix("_total")


def _labels(labels: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else ""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    url = args.url or f"http://{args.host}:{args.metrics_port}/metrics"
    metrics = expand(args.metric)
    previous: dict[str, dict[str, Reading]] = {}
    last = 0.0
    scrapes = 0
    try:
        while True:
            try:
                text = scrape(url)
            except (urllib.error.URLError, OSError) as exc:
                print(f"{time.strftime('%H:%M:%S')} cannot scrape {url}: {exc}", file=sys.stderr, flush=True)
            else:
                now = time.monotonic()
                current = readings(text, metrics)
                missing = [n for n in metrics if n not in current]
                if missing:
                    print(unknown(missing, text, url), file=sys.stderr)
                    return 2
                stamp = time.strftime("%H:%M:%S")
                for name in metrics:
                    for labels, reading in current[name].items():
                        before = previous.get(name, {}).get(labels)
                        print(f"{stamp} {describe(name, reading, before, now - last)}", flush=True)
                previous, last = current, now
            scrapes += 1
            if args.count and scrapes >= args.count:
                return 0
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
